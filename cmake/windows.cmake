# What the Windows cross build makes (included by the top-level
# CMakeLists.txt when CMAKE_SYSTEM_NAME is Windows): the platform layer and
# its tests, run under Wine by ctest. docs/windows.md says what is ported so
# far and what is not.
add_library(hearth_platform STATIC
  ${PROJECT_SOURCE_DIR}/src/common/status.cc
  ${PROJECT_SOURCE_DIR}/src/platform/identity_windows.cc
  ${PROJECT_SOURCE_DIR}/src/platform/local_channel_windows.cc
  ${PROJECT_SOURCE_DIR}/src/platform/section.cc
  ${PROJECT_SOURCE_DIR}/src/platform/section_windows.cc)
target_include_directories(hearth_platform PUBLIC ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src)
target_compile_options(hearth_platform PUBLIC -Wall -Wextra -Wpedantic -Werror)
target_link_libraries(hearth_platform PUBLIC advapi32)
# Static: the executables run under Wine without MinGW's DLLs beside them.
target_link_options(hearth_platform PUBLIC -static)

enable_testing()
add_executable(section_windows_test ${PROJECT_SOURCE_DIR}/tests/platform/section_windows_test.cc)
target_link_libraries(section_windows_test PRIVATE hearth_platform)
add_test(NAME section_windows COMMAND section_windows_test)
set_tests_properties(section_windows PROPERTIES TIMEOUT 300)
add_executable(channel_windows_test ${PROJECT_SOURCE_DIR}/tests/platform/channel_windows_test.cc)
target_link_libraries(channel_windows_test PRIVATE hearth_platform)
add_test(NAME channel_windows COMMAND channel_windows_test)
set_tests_properties(channel_windows PROPERTIES TIMEOUT 300)
