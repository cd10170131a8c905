// The C ABI against a real store process.
#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>
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

TEST(CApi, OptionsAreCheckedAndAttachWithOptionsWorksAsAttach) {
  EXPECT_EQ(hearth_abi_version(), HEARTH_ABI_VERSION);
  EXPECT_EQ(HEARTH_ABI_VERSION, 8);
  testing::TempDir dir;
  const std::string model = dir.File("m.safetensors");
  testing::WriteTestCheckpoint(model, 2, 100, 3);
  const std::string socket = dir.File("s.sock");
  testing::StoreProcess store(socket, {"--device", "cpu", "--model", "w=" + model});
  ASSERT_EQ(store.startup_error(), "");

  hearth_attachment* a = nullptr;
  hearth_attach_options options{};
  options.size = sizeof options;
  options.socket_path = socket.c_str();
  ASSERT_EQ(hearth_attach_with_options(&options, "w", 0, &a), HEARTH_OK) << hearth_last_error();
  EXPECT_EQ(hearth_tensor_count(a), 4u);
  hearth_detach(a);

  options.size = sizeof(size_t);  // a caller that filled in less than version 2 has
  EXPECT_EQ(hearth_attach_with_options(&options, "w", 0, &a), HEARTH_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::strstr(hearth_last_error(), "size"), nullptr) << hearth_last_error();
  options.size = sizeof options;
  options.trusted_store_uid_count = 1;
  EXPECT_EQ(hearth_attach_with_options(&options, "w", 0, &a), HEARTH_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(a, nullptr);
}

// A caller built against a later header passes a larger struct: bytes past
// version 2's fields must be zero (a field this library does not know is
// unset), else the call fails naming the offset instead of ignoring it.
TEST(CApi, SetBytesPastTheVersion2OptionsAreRefused) {
  testing::TempDir dir;
  const std::string model = dir.File("m.safetensors");
  testing::WriteTestCheckpoint(model, 2, 100, 3);
  const std::string socket = dir.File("s.sock");
  testing::StoreProcess store(socket, {"--device", "cpu", "--model", "w=" + model});
  ASSERT_EQ(store.startup_error(), "");

  struct Later {
    hearth_attach_options v2;
    uint32_t stricter_option;
    uint32_t reserved;
  } later{};
  later.v2.size = sizeof later;
  later.v2.socket_path = socket.c_str();
  hearth_attachment* a = nullptr;
  ASSERT_EQ(hearth_attach_with_options(&later.v2, "w", 0, &a), HEARTH_OK) << hearth_last_error();
  hearth_detach(a);
  a = nullptr;

  later.stricter_option = 1;
  EXPECT_EQ(hearth_attach_with_options(&later.v2, "w", 0, &a), HEARTH_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(a, nullptr);
  const std::string offset = "offset " + std::to_string(offsetof(Later, stricter_option));
  EXPECT_NE(std::strstr(hearth_last_error(), offset.c_str()), nullptr) << hearth_last_error();

  later.stricter_option = 0;
  later.v2.size = size_t{1} << 20;  // garbage, not a later version
  EXPECT_EQ(hearth_attach_with_options(&later.v2, "w", 0, &a), HEARTH_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::strstr(hearth_last_error(), "larger than"), nullptr) << hearth_last_error();
}

// A store run by another uid (setpriv, as root) is refused unless trusted.
TEST(CApi, AStoreOfAnotherUidIsRefusedUnlessTrusted) {
  if (std::string why = testing::WhyNoOtherUid(); !why.empty()) GTEST_SKIP() << why;
  constexpr uid_t kOther = 54330;
  ::unsetenv("HEARTH_STORE_UID");
  testing::TempDir dir;
  ASSERT_EQ(::chmod(dir.path().c_str(), 0711), 0);
  const std::string model = dir.File("m.safetensors");
  testing::WriteTestCheckpoint(model, 2, 100, 3);
  ASSERT_EQ(::chmod(model.c_str(), 0644), 0);
  testing::MakeDirectoryOwnedBy(dir.File("other"), kOther);
  const std::string socket = dir.File("other/s.sock");
  testing::StoreProcessOptions as_other;
  as_other.prefix = testing::AsUid(kOther);
  testing::StoreProcess store(
      socket, {"--device", "cpu", "--socket-mode", "0666", "--model", "w=" + model}, as_other);
  ASSERT_EQ(store.startup_error(), "");

  hearth_attachment* a = nullptr;
  ASSERT_EQ(hearth_attach(socket.c_str(), "w", 0, &a), HEARTH_ERROR_PERMISSION_DENIED);
  EXPECT_EQ(a, nullptr);
  const std::string error = hearth_last_error();
  EXPECT_NE(error.find(socket), std::string::npos) << error;
  EXPECT_NE(error.find("uid " + std::to_string(kOther)), std::string::npos) << error;
  EXPECT_NE(error.find("pid " + std::to_string(store.pid())), std::string::npos) << error;

  const uint32_t trusted[] = {kOther};
  hearth_attach_options options{};
  options.size = sizeof options;
  options.socket_path = socket.c_str();
  options.trusted_store_uids = trusted;
  options.trusted_store_uid_count = 1;
  ASSERT_EQ(hearth_attach_with_options(&options, "w", 0, &a), HEARTH_OK) << hearth_last_error();
  hearth_detach(a);

  ASSERT_EQ(::setenv("HEARTH_STORE_UID", std::to_string(kOther).c_str(), 1), 0);
  a = nullptr;
  EXPECT_EQ(hearth_attach(socket.c_str(), "w", 0, &a), HEARTH_OK) << hearth_last_error();
  hearth_detach(a);
  ::unsetenv("HEARTH_STORE_UID");
}

TEST(CApi, LibraryExportsOnlyTheCInterface) {
  void* lib = dlopen(HEARTH_LIBRARY_PATH, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(lib, nullptr) << dlerror();
  EXPECT_NE(dlsym(lib, "hearth_attach"), nullptr);
  EXPECT_NE(dlsym(lib, "hearth_last_error"), nullptr);
  EXPECT_EQ(
      dlsym(lib, "_ZN6hearth12AttachClient6AttachESt17basic_string_viewIcSt11char_traitsIcEEm"),
      nullptr);
  dlclose(lib);
}

}  // namespace
}  // namespace hearth
