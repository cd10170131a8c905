/* Compiled as C: the public header must be valid C99 on its own. */
#include "hearth/hearth.h"

int hearth_c_header_check(void) {
  hearth_tensor_info info;
  info.ndim = 0;
  return hearth_abi_version() == HEARTH_ABI_VERSION && info.ndim == 0;
}
