// The C ABI against a real store process.
#include <dlfcn.h>

#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "hearth/checkpoint.h"
#include "hearth/hearth.h"
#include "support/test_store.h"

extern "C" int hearth_c_header_check(void);

namespace hearth {
namespace {

TEST(CApi, HeaderIsValidC) { EXPECT_EQ(hearth_c_header_check(), 1); }

TEST(CApi, AttachEnumerateCopyDetach) {
  testing::TempDir dir;
  const std::string model = dir.File("m.safetensors");
  testing::WriteTestCheckpoint(model, 3, 5000, 9);
  const std::string socket = dir.File("s.sock");
  testing::StoreProcess store(socket, {"--device", "cpu", "--model", "w=" + model});
  ASSERT_EQ(store.startup_error(), "");

  hearth_attachment* a = nullptr;
  ASSERT_EQ(hearth_attach(socket.c_str(), "w", 0, &a), HEARTH_OK) << hearth_last_error();
  ASSERT_NE(a, nullptr);
  EXPECT_STREQ(hearth_model_name(a), "w");
  EXPECT_EQ(hearth_model_version(a), 1u);
  EXPECT_EQ(hearth_device_type(a), HEARTH_DEVICE_CPU);

  auto ckpt = Checkpoint::Open(model);
  ASSERT_TRUE(ckpt.ok());
  ASSERT_EQ(hearth_tensor_count(a), ckpt->tensors().size());
  for (size_t i = 0; i < hearth_tensor_count(a); ++i) {
    hearth_tensor_info info;
    ASSERT_EQ(hearth_tensor_info_at(a, i, &info), HEARTH_OK);
    const TensorInfo& t = ckpt->tensors()[i];
    EXPECT_STREQ(info.name, t.name.c_str());
    EXPECT_STREQ(info.dtype_name, std::string(DTypeName(t.dtype)).c_str());
    ASSERT_EQ(info.ndim, static_cast<int32_t>(t.shape.size()));
    for (int d = 0; d < info.ndim; ++d) EXPECT_EQ(info.shape[d], t.shape[d]);
    std::vector<std::byte> expected(t.nbytes), copied(t.nbytes);
    ASSERT_TRUE(ckpt->Read(t, 0, expected).ok());
    ASSERT_EQ(hearth_copy_to_host(a, i, 0, copied.data(), copied.size()), HEARTH_OK);
    EXPECT_EQ(copied, expected) << t.name;
    if (t.nbytes > 0) EXPECT_EQ(std::memcmp(info.data, expected.data(), t.nbytes), 0);
  }
  hearth_tensor_info info;
  EXPECT_EQ(hearth_tensor_info_by_name(a, "t1", &info), HEARTH_OK);
  EXPECT_STREQ(info.name, "t1");
  EXPECT_EQ(hearth_tensor_info_by_name(a, "nope", &info), HEARTH_ERROR_NOT_FOUND);
  EXPECT_NE(std::strstr(hearth_last_error(), "nope"), nullptr);
  EXPECT_EQ(hearth_tensor_info_at(a, 999, &info), HEARTH_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(hearth_copy_to_host(a, 0, 1ull << 40, &info, 1), HEARTH_ERROR_INVALID_ARGUMENT);
  hearth_detach(a);
  hearth_detach(nullptr);
}

TEST(CApi, ErrorsAreCodesAndMessagesNeverExceptions) {
  hearth_attachment* a = reinterpret_cast<hearth_attachment*>(0x1);
  EXPECT_EQ(hearth_attach("/nonexistent/hearth.sock", "m", 0, &a), HEARTH_ERROR_UNAVAILABLE);
  EXPECT_EQ(a, nullptr);
  EXPECT_NE(std::strstr(hearth_last_error(), "/nonexistent/hearth.sock"), nullptr);
  EXPECT_EQ(hearth_attach(nullptr, "", 0, &a), HEARTH_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(hearth_attach(nullptr, "m", 0, nullptr), HEARTH_ERROR_INVALID_ARGUMENT);
}

TEST(CApi, LibraryExportsOnlyTheCInterface) {
  void* lib = dlopen(HEARTH_LIBRARY_PATH, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(lib, nullptr) << dlerror();
  EXPECT_NE(dlsym(lib, "hearth_attach"), nullptr);
  EXPECT_NE(dlsym(lib, "hearth_last_error"), nullptr);
  EXPECT_EQ(dlsym(lib, "_ZN6hearth12AttachClient6AttachESt17basic_string_viewIcSt11char_traitsIcEEm"), nullptr);
  dlclose(lib);
}

}  // namespace
}  // namespace hearth
