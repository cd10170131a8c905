"""Triton's `triton_python_backend_utils` for models that hearth's Python
backend serves unchanged: `import triton_python_backend_utils as pb_utils`.
The implementation is hearth._triton; docs/python-backend.md, "Triton Python
models", says what hearth offers of it and what it does not."""

from hearth._triton import *  # noqa: F401,F403
from hearth._triton import __all__  # noqa: F401
