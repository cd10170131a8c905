#include "common/bytes_tensor.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace hearth {
namespace {

using namespace std::string_view_literals;

std::vector<std::byte> Raw(std::string_view text) {
  const auto* p = reinterpret_cast<const std::byte*>(text.data());
  return std::vector<std::byte>(p, p + text.size());
}

std::vector<std::byte> Encode(std::initializer_list<std::string_view> elements) {
  std::vector<std::byte> out;
  for (std::string_view element : elements) {
    EXPECT_TRUE(AppendBytesElement(out, element, "t").ok());
  }
  return out;
}

std::vector<std::string> Decode(std::span<const std::byte> data) {
  std::vector<std::string> out;
  for (std::string_view element : BytesElements(data)) out.emplace_back(element);
  return out;
}

void ExpectInvalid(const Status& status, std::initializer_list<std::string> needles) {
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  for (const std::string& needle : needles) {
    EXPECT_NE(status.message().find(needle), std::string::npos)
        << "'" << status.message() << "' lacks '" << needle << "'";
  }
}

TEST(BytesTensor, AppendWritesLittleEndianLengthThenBytes) {
  const std::vector<std::byte> data = Encode({"ab", "", "\0z"sv});
  EXPECT_EQ(data, Raw("\x02\x00\x00\x00"
                      "ab"
                      "\x00\x00\x00\x00"
                      "\x02\x00\x00\x00\x00z"sv));
  std::vector<std::byte> long_one;
  const std::string k300(300, 'q');
  ASSERT_TRUE(AppendBytesElement(long_one, k300, "t").ok());
  ASSERT_EQ(long_one.size(), 304u);
  EXPECT_EQ(long_one[0], std::byte{0x2c});
  EXPECT_EQ(long_one[1], std::byte{0x01});
  EXPECT_EQ(long_one[2], std::byte{0});
  EXPECT_EQ(BytesElementSize(300), 304u);
}

TEST(BytesTensor, IteratesElementsAsViews) {
  const std::vector<std::byte> data = Encode({"hello", "", "\0\xff\x01"sv, "\xc3\xa9"});
  EXPECT_EQ(Decode(data),
            (std::vector<std::string>{"hello", "", std::string("\0\xff\x01", 3), "\xc3\xa9"}));
  BytesElements elements(data);
  auto it = elements.begin();
  EXPECT_EQ(it.offset(), 0u);
  EXPECT_EQ(reinterpret_cast<const std::byte*>(it->data()), data.data() + 4);  // no copy
  ++it;
  EXPECT_EQ(it.offset(), 9u);
  EXPECT_TRUE(Decode({}).empty());
  EXPECT_TRUE(BytesElements({}).begin() == BytesElements({}).end());
}

TEST(BytesTensor, IterationStopsAtAMalformedElement) {
  std::vector<std::byte> data = Encode({"ab", "cd"});
  data.pop_back();  // the second element's length now runs past the end
  EXPECT_EQ(Decode(data), (std::vector<std::string>{"ab"}));
  const std::vector<std::byte> short_prefix = Raw("\x01\x00"sv);
  EXPECT_TRUE(Decode(short_prefix).empty());
  const std::vector<std::byte> huge =
      Raw("\xff\xff\xff\xff"
          "abc"sv);
  EXPECT_TRUE(Decode(huge).empty());
}

TEST(BytesTensor, ValidatesExactElementCounts) {
  const std::vector<std::byte> three = Encode({"a", "", "bc"});
  EXPECT_TRUE(ValidateBytesTensor(three, 3, "input \"s\"").ok());
  EXPECT_TRUE(ValidateBytesTensor({}, 0, "input \"s\"").ok());
  const std::vector<std::byte> empties = Encode({"", "", "", ""});
  EXPECT_TRUE(ValidateBytesTensor(empties, 4, "x").ok());
  ExpectInvalid(ValidateBytesTensor(three, 4, "input \"s\""),
                {"input \"s\"", "too few elements", "3 where 4 are expected"});
  ExpectInvalid(ValidateBytesTensor(three, 2, "input \"s\""),
                {"input \"s\"", "too many elements", "3 where 2 are expected"});
  ExpectInvalid(ValidateBytesTensor(three, 0, "input \"s\""), {"too many elements"});
  // A count far beyond what the data could hold is checked, not walked.
  ExpectInvalid(ValidateBytesTensor(three, uint64_t{1} << 62, "x"), {"too few elements"});
}

TEST(BytesTensor, ValidationSaysWhichElementAndWhy) {
  std::vector<std::byte> data = Encode({"abc", "de"});
  std::vector<std::byte> truncated_prefix(data.begin(), data.begin() + 9);  // 2 of 4 prefix bytes
  ExpectInvalid(ValidateBytesTensor(truncated_prefix, 2, "input \"s\""),
                {"input \"s\"", "BYTES element 1", "at byte 7", "truncated length prefix",
                 "2 of its 4 bytes"});
  std::vector<std::byte> past_end(data.begin(), data.end() - 1);
  ExpectInvalid(ValidateBytesTensor(past_end, 2, "input \"s\""),
                {"input \"s\"", "BYTES element 1", "at byte 7", "length 2",
                 "past the end of the data", "1 bytes follow"});
  // A length prefix of 2^32 - 1 with a few bytes after it.
  const std::vector<std::byte> huge =
      Raw("\xff\xff\xff\xff"
          "abc"sv);
  ExpectInvalid(ValidateBytesTensor(huge, 1, "x"),
                {"BYTES element 0", "length 4294967295", "past the end"});
  // Bytes after the last element that make no whole element.
  std::vector<std::byte> trailing = data;
  trailing.push_back(std::byte{1});
  trailing.push_back(std::byte{0});
  ExpectInvalid(ValidateBytesTensor(trailing, 2, "input \"s\""),
                {"input \"s\"", "2 trailing bytes after its 2 elements", "from byte 13"});
  // A whole element, then a fragment: still trailing bytes, counted from the end of element 1.
  std::vector<std::byte> element_then_fragment = Encode({"abc", "de", "f"});
  element_then_fragment.push_back(std::byte{7});
  ExpectInvalid(ValidateBytesTensor(element_then_fragment, 2, "x"),
                {"6 trailing bytes after its 2 elements"});
}

TEST(BytesTensor, CountsElements) {
  EXPECT_EQ(*CountBytesElements(Encode({"a", "b", ""}), "t"), 3u);
  EXPECT_EQ(*CountBytesElements({}, "t"), 0u);
  const std::vector<std::byte> broken =
      Raw("\x05\x00\x00\x00"
          "ab"sv);
  ExpectInvalid(CountBytesElements(broken, "output \"o\"").status(),
                {"output \"o\"", "BYTES element 0", "past the end"});
  ExpectInvalid(CountBytesElements(Raw("\x00"sv), "t").status(), {"truncated length prefix"});
}

}  // namespace
}  // namespace hearth
