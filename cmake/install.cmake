# `cmake --install BUILD --prefix PREFIX`: what `hearth serve` and Python
# programs need at run time, laid out where the binaries look for it:
#   PREFIX/bin/hearth, PREFIX/bin/hearth-worker and the backend plug-ins
#     (libhearth_backends_cuda.so, libhearth_backend_aoti.so) beside it,
#     where hearth-worker dlopen()s them first;
#   PREFIX/lib/libhearth.so, the C ABI (backend: python's workers and the
#     Python package load it);
#   PREFIX/lib/hearth/python, the Python package, which backend: python's
#     workers find there (PREFIX/bin/../lib/hearth/python).
# The installed binaries carry no build-tree RPATH; scripts/image builds the
# container image from this tree.
install(TARGETS hearth_cli hearth_worker RUNTIME DESTINATION bin)
install(TARGETS hearth LIBRARY DESTINATION lib)
foreach(plugin IN ITEMS hearth_backends_cuda hearth_backend_aoti)
  if(TARGET ${plugin})
    install(TARGETS ${plugin} LIBRARY DESTINATION bin)
  endif()
endforeach()
install(DIRECTORY ${PROJECT_SOURCE_DIR}/python/hearth DESTINATION lib/hearth/python
        PATTERN __pycache__ EXCLUDE)
install(FILES ${PROJECT_SOURCE_DIR}/python/triton_python_backend_utils.py DESTINATION lib/hearth/python)
