"""Value types of the IR: tensors (shape, dtype, device) and references to live autograd nodes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPE_NAMES = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(t: torch.Tensor) -> TensorType:
        return TensorType(tuple(t.shape), t.dtype, t.device)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def with_(self, shape=None, dtype=None, device=None) -> TensorType:
        return TensorType(
            self.shape if shape is None else tuple(shape),
            self.dtype if dtype is None else dtype,
            self.device if device is None else device,
        )

    def __str__(self) -> str:
        return f"{dtype_name(self.dtype)}[{', '.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class NodeType:
    """A live autograd node, bound at run time, for opaque calls."""

    name: str

    def __str__(self) -> str:
        return f"node<{self.name}>"
