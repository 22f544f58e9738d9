"""Hand-written Triton kernels that read tensor addresses from a device pointer table.

A captured CUDA graph bakes every kernel argument, while the tensors a backward reads and writes
change address on every call. These kernels take their changing base pointers from an int64
device tensor (the pointer table, refreshed by one small host-to-device copy before each replay),
so every launch argument stays fixed and the launches can be captured once and replayed:

- `table_copy.TableCopy`: a multi-tensor copy between table-addressed tensors and static
  buffers, one launch per element size, bit-exact for any dtype. It feeds library calls (cuBLAS
  matmul) that can't read a table: their dynamic inputs are copied into static buffers inside the
  graph, and their static outputs copied out.
- `table_matmul.TableMatmul`: matmul and batched matmul whose A, B and C base pointers each come
  from a table slot or a fixed tensor, a replacement for the library call that needs no copies.

Imported as `gpuautograd.triton_kernels` (the package links this folder); this folder is not a
distribution of its own.
"""

from .table_copy import MAX_CHUNK_PROGRAMS, TableCopy, span
from .table_matmul import TableMatmul, matmul_strides

__all__ = ["MAX_CHUNK_PROGRAMS", "TableCopy", "TableMatmul", "matmul_strides", "span"]
