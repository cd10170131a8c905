# What the Windows cross build makes (included by the top-level
# CMakeLists.txt when CMAKE_SYSTEM_NAME is Windows): the platform layer, the
# store and the attach client on it, and their tests, run under Wine by
# ctest. docs/windows.md says what is ported so far and what is not.

# hearth.exe, hearth.dll and the tests in build-windows/bin, where the Python
# package looks for hearth.dll (python/hearth/_platform.py).
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)

# The header-only libraries the Linux build finds as packages (spdlog with
# fmt, nlohmann/json, CLI11, xxHash), taken from the build machine's
# /usr/include one by one: the whole folder would put glibc's headers before
# MinGW's.
set(HEARTH_HOST_HEADERS ${CMAKE_BINARY_DIR}/host-headers)
file(MAKE_DIRECTORY ${HEARTH_HOST_HEADERS})
foreach(entry spdlog fmt nlohmann CLI xxhash.h)
  if(NOT EXISTS /usr/include/${entry})
    message(FATAL_ERROR "/usr/include/${entry} is missing: scripts/setup installs it")
  endif()
  file(CREATE_LINK /usr/include/${entry} ${HEARTH_HOST_HEADERS}/${entry} SYMBOLIC)
endforeach()

add_library(hearth_platform STATIC
  ${PROJECT_SOURCE_DIR}/src/common/status.cc
  ${PROJECT_SOURCE_DIR}/src/platform/file_io_windows.cc
  ${PROJECT_SOURCE_DIR}/src/platform/identity_windows.cc
  ${PROJECT_SOURCE_DIR}/src/platform/local_channel_windows.cc
  ${PROJECT_SOURCE_DIR}/src/platform/section.cc
  ${PROJECT_SOURCE_DIR}/src/platform/section_windows.cc)
target_include_directories(hearth_platform PUBLIC ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src)
target_include_directories(hearth_platform SYSTEM PUBLIC ${HEARTH_HOST_HEADERS})
target_compile_definitions(hearth_platform PUBLIC FMT_HEADER_ONLY XXH_INLINE_ALL _FILE_OFFSET_BITS=64)
target_compile_options(hearth_platform PUBLIC -Wall -Wextra -Wpedantic -Werror)
target_link_libraries(hearth_platform PUBLIC advapi32)
# Static: the executables run under Wine without MinGW's DLLs beside them.
target_link_options(hearth_platform PUBLIC -static)

# The store, the attach client and what they share with Linux: common,
# checkpoint, memory (host arenas), protocol; one library here.
set(src ${PROJECT_SOURCE_DIR}/src)
add_library(hearth_core STATIC
  ${src}/common/checked_size.cc ${src}/common/checksum.cc ${src}/common/checksum_avx2.cc
  ${src}/common/device.cc ${src}/common/dtype.cc ${src}/common/manifest.cc
  ${src}/checkpoint/checkpoint.cc ${src}/checkpoint/checkpoint_index.cc
  ${src}/checkpoint/safetensors_format.cc ${src}/checkpoint/safetensors_reader.cc
  ${src}/checkpoint/safetensors_writer.cc ${src}/checkpoint/strict_json.cc
  ${src}/checkpoint/synthetic.cc
  ${src}/memory/arena.cc ${src}/memory/host_arena.cc ${src}/memory/mapping_windows.cc
  ${src}/protocol/wire.cc ${src}/protocol/wire_pipe.cc ${src}/protocol/messages.cc
  ${src}/store/registry.cc ${src}/store/loader.cc ${src}/store/store_device.cc
  ${src}/store/store_windows.cc
  ${src}/attach/attachment.cc ${src}/attach/attach_client_windows.cc)
set_source_files_properties(${src}/common/checksum_avx2.cc PROPERTIES COMPILE_OPTIONS "-mavx2")

# CUDA arenas (CU_MEM_HANDLE_TYPE_WIN32): compiled, never run here
# (docs/windows.md). nvcuda.dll is loaded at run time, so nothing links
# against CUDA; only the driver API's two headers, cuda.h and cudaTypedefs.h,
# are taken from the toolkit, one by one as above (the rest of its include
# folder is the runtime's, which hearth does not use).
set(HEARTH_CUDA_INCLUDE /usr/local/cuda/include CACHE PATH
    "Where cuda.h and cudaTypedefs.h are (CUDA 12 or later); empty: CUDA arenas not built")
if(HEARTH_CUDA_INCLUDE AND EXISTS ${HEARTH_CUDA_INCLUDE}/cuda.h)
  set(HEARTH_CUDA_HEADERS ${CMAKE_BINARY_DIR}/cuda-headers)
  file(MAKE_DIRECTORY ${HEARTH_CUDA_HEADERS})
  foreach(entry cuda.h cudaTypedefs.h)
    file(CREATE_LINK ${HEARTH_CUDA_INCLUDE}/${entry} ${HEARTH_CUDA_HEADERS}/${entry} SYMBOLIC)
  endforeach()
  target_sources(hearth_core PRIVATE
    ${src}/memory/cuda_driver.cc ${src}/memory/cuda_driver_windows.cc
    ${src}/memory/cuda_arena.cc ${src}/memory/cuda_arena_windows.cc ${src}/memory/cuda_mapping.cc)
  target_include_directories(hearth_core SYSTEM PRIVATE ${HEARTH_CUDA_HEADERS})
  target_compile_definitions(hearth_core PRIVATE HEARTH_HAVE_CUDA=1)
  message(STATUS "CUDA arenas: built, with the driver API headers of ${HEARTH_CUDA_INCLUDE}")
else()
  message(STATUS "CUDA arenas: not built (no cuda.h in HEARTH_CUDA_INCLUDE='${HEARTH_CUDA_INCLUDE}')")
endif()
# GCC 12's -Wrestrict misfires on std::string at -O3 (GCC bug 105329).
target_compile_options(hearth_core PRIVATE -Wno-restrict)
target_link_libraries(hearth_core PUBLIC hearth_platform)

# hearth.exe: store, inspect, make-model, list, status, load and unload;
# serve and bench refuse (src/cli/main.cc).
add_executable(hearth_cli
  ${src}/cli/main.cc ${src}/cli/cli_common.cc ${src}/cli/store_command.cc
  ${src}/cli/inspect_command.cc ${src}/cli/make_model_command.cc ${src}/cli/admin_commands.cc)
set_target_properties(hearth_cli PROPERTIES OUTPUT_NAME hearth)
target_link_libraries(hearth_cli PRIVATE hearth_core)

# hearth.dll: the C ABI of libhearth.so (include/hearth/hearth.h), exporting
# exactly the functions the header declares (a .def file made from it).
file(READ ${PROJECT_SOURCE_DIR}/include/hearth/hearth.h hearth_h)
string(REGEX MATCHALL "[ *](hearth_[a-z0-9_]+)\\(" hearth_functions "${hearth_h}")
list(TRANSFORM hearth_functions REPLACE "[ *](hearth_[a-z0-9_]+)\\(" "  \\1")
list(REMOVE_DUPLICATES hearth_functions)
list(JOIN hearth_functions "\n" hearth_exports)
file(WRITE ${CMAKE_BINARY_DIR}/hearth.def "EXPORTS\n${hearth_exports}\n")
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
             ${PROJECT_SOURCE_DIR}/include/hearth/hearth.h)
add_library(hearth SHARED ${src}/capi/hearth_c.cc ${CMAKE_BINARY_DIR}/hearth.def)
target_compile_definitions(hearth PRIVATE HEARTH_BUILDING_LIBRARY)
target_link_libraries(hearth PRIVATE hearth_core)
set_target_properties(hearth PROPERTIES PREFIX "")

enable_testing()
add_executable(section_windows_test ${PROJECT_SOURCE_DIR}/tests/platform/section_windows_test.cc)
target_link_libraries(section_windows_test PRIVATE hearth_platform)
add_test(NAME section_windows COMMAND section_windows_test)
set_tests_properties(section_windows PROPERTIES TIMEOUT 300)
add_executable(channel_windows_test ${PROJECT_SOURCE_DIR}/tests/platform/channel_windows_test.cc)
target_link_libraries(channel_windows_test PRIVATE hearth_platform)
add_test(NAME channel_windows COMMAND channel_windows_test)
set_tests_properties(channel_windows PROPERTIES TIMEOUT 300)
# The store in this process, its clients in children (docs/windows.md).
add_executable(store_windows_test ${PROJECT_SOURCE_DIR}/tests/store/store_windows_test.cc)
target_include_directories(store_windows_test PRIVATE ${PROJECT_SOURCE_DIR})
target_link_libraries(store_windows_test PRIVATE hearth_core)
add_dependencies(store_windows_test hearth)  # its "capi" child loads hearth.dll
add_test(NAME store_windows COMMAND store_windows_test)
set_tests_properties(store_windows PROPERTIES TIMEOUT 300)
