// What the Windows tests (run under Wine, without gtest) check with: CHECK
// counts a failure and says where and why, and the test goes on.
#pragma once

#include <cstdio>

namespace hearth::platform::test {
inline int failures = 0;
}  // namespace hearth::platform::test

#define CHECK(cond, ...)                                                      \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::fprintf(stderr, "%s:%d: failed: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                      \
      std::fprintf(stderr, "\n");                                             \
      ++hearth::platform::test::failures;                                     \
    }                                                                         \
  } while (0)
