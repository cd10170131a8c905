// cblas.h from OpenBLAS, wherever the distribution puts it: CMake adds the
// directory that holds OpenBLAS's own cblas.h (Debian and Ubuntu:
// /usr/include/<triplet>/openblas-pthread) ahead of the alternatives symlink.
#pragma once

#include <cblas.h>
