"""Bit packing of KV-cache codes: fixed-width rows (`pack_codes`) and per-channel-width rows (`pack_codes_var`).

Bit layout of packed codes (`pack_codes` / `unpack_codes`), bits b in {1, 2, 3, 4}:
  A row of D codes is one little-endian bitstream of D * b bits stored in D * b / 8 bytes. Code i occupies
  stream bits [i*b, i*b + b), least-significant bit first; byte j holds stream bits [8j, 8j + 8).
  b=4: code 2j in the low nibble of byte j, code 2j+1 in the high nibble.
  b=2: byte j holds codes 4j..4j+3 at bit offsets 0, 2, 4, 6.
  b=1: byte j holds codes 8j..8j+7, code 8j + i at bit i (a layer's 1-bit value codes, `actors.kv.layer_widths`).
  b=3: every 8 codes fill exactly 3 bytes; codes 2 and 5 of each group of 8 straddle a byte boundary
       (code 2 = bits 6-7 of byte 0 + bit 0 of byte 1). A 3-bit code costs exactly 3/8 byte.
  Requires D * b % 8 == 0 (D % 8 == 0 for 3 bits).

Per-channel widths (`pack_codes_var` / `unpack_codes_var`): channel d of head h has its own width b[h, d] in
[1, 8], every head's widths summing to the same B. The codes of a (token, head) row are one bitstream with
the same rule, channel d at bit offset sum(b[h, :d]) (`channel_bit_offsets`), zero-padded to
Pk = ceil(B / 8) bytes. On CPU all four run as one compiled pass (kernels/csrc/kv_bits.c) when the kernels are built;
the PyTorch ops here are the reference (and the path elsewhere).

Shape legend: N = tokens, H = KV heads, D = head_dim (codes per row), P = packed bytes per row
(D * bits / 8), Pk = packed bytes of a per-channel-width row.
"""
from __future__ import annotations

import functools
import weakref

import torch

# 1 bit serves as one layer's value width inside a 2-bit profile (sensitivity-allocated layer widths); a profile's
# own width (`actors.kv.profiles.ModelKVProfile.bits`, `--kv-bits`) stays 2, 3 or 4.
SUPPORTED_BITS = (1, 2, 3, 4)


def _check_bits(bits: int, name: str = "bits") -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{name}={bits} is not supported; choose one of {SUPPORTED_BITS}")


def packed_bytes(head_dim: int, bits: int) -> int:
    """Bytes of one packed row of `head_dim` codes at `bits` bits each (P in the legend).

    Raises:
        ValueError: bits not in {1, 2, 3, 4}, or head_dim * bits not a multiple of 8.
    """
    _check_bits(bits)
    if head_dim <= 0 or (head_dim * bits) % 8:
        raise ValueError(f"head_dim={head_dim} * bits={bits} must be a positive multiple of 8 to pack densely")
    return head_dim * bits // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes densely along the last dim (layout in the module docstring).

    Args:
        codes: [..., D] integer tensor with values in [0, 2**bits).
        bits: 1, 2, 3 or 4 bits per code.
    Returns:
        [..., D * bits / 8] uint8.
    Raises:
        ValueError: unsupported bits, or D * bits not a multiple of 8.
    """
    d = codes.shape[-1]
    p = packed_bytes(d, bits)
    fast = _compiled_pack(codes.reshape(-1, 1, d), _uniform(d, bits), p)  # every width = bits: this layout
    if fast is not None:
        return fast.view(*codes.shape[:-1], p)
    c = codes.to(torch.int32)
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = ((c.unsqueeze(-1) >> shifts) & 1).reshape(*codes.shape[:-1], p, 8)  # [..., P, 8] bits
    weights = torch.arange(8, device=codes.device, dtype=torch.int32)
    return (stream << weights).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """Inverse of `pack_codes`.

    Args:
        packed: [..., P] uint8 with P = head_dim * bits / 8.
        bits: 1, 2, 3 or 4.
        head_dim: D, the number of codes per row.
    Returns:
        [..., D] int64 codes in [0, 2**bits).
    Raises:
        ValueError: unsupported bits, or packed.shape[-1] != head_dim * bits / 8.
    """
    p = packed_bytes(head_dim, bits)
    if packed.shape[-1] != p:
        raise ValueError(f"packed.shape[-1]={packed.shape[-1]} != head_dim*bits/8={p}")
    fast = _compiled_unpack(packed.reshape(-1, 1, p), _uniform(head_dim, bits))
    if fast is not None:
        return fast.view(*packed.shape[:-1], head_dim)
    weights = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = ((packed.to(torch.int32).unsqueeze(-1) >> weights) & 1).reshape(*packed.shape[:-1], head_dim, bits)
    shifts = torch.arange(bits, device=packed.device, dtype=torch.int32)
    return (stream << shifts).sum(-1).to(torch.int64)


MAX_CHANNEL_BITS = 8


# id(widths) -> (weak reference, what it held, result): a profile's widths are checked once, not on every layer of
# every decode step (each check is ~6 tensor ops; `KVQuantProfile.k_packed_bytes` asks for it on every call)
_CHECKED: dict[int, tuple] = {}


def _held(widths_HD: torch.Tensor):
    """What identifies the tensor's contents now: its version counter, or a copy for an inference tensor (which has
    none)."""
    return widths_HD.clone() if widths_HD.is_inference() else widths_HD._version


def _check_widths(widths_HD: torch.Tensor) -> tuple[int, int]:
    """(bits per head row, packed bytes Pk) of per-channel widths [H, D]; ValueError naming the limit. Remembered per
    tensor (until it is modified in place)."""
    hit = _CHECKED.get(id(widths_HD))
    if hit is not None and hit[0]() is widths_HD:
        held = hit[1]
        if (torch.equal(held, widths_HD) if isinstance(held, torch.Tensor) else held == widths_HD._version):
            return hit[2]
    out = _widths_of(widths_HD)
    if len(_CHECKED) >= 256:
        _CHECKED.clear()
    _CHECKED[id(widths_HD)] = (weakref.ref(widths_HD), _held(widths_HD), out)
    return out


def _widths_of(widths_HD: torch.Tensor) -> tuple[int, int]:
    if widths_HD.dim() != 2:
        raise ValueError(f"k_bits.shape={tuple(widths_HD.shape)} must be [H, D]")
    w = widths_HD.to(torch.int64)
    if w.numel() == 0 or int(w.min()) < 1 or int(w.max()) > MAX_CHANNEL_BITS:
        raise ValueError(f"k_bits values must lie in [1, {MAX_CHANNEL_BITS}]")
    sums = w.sum(dim=1)
    if bool((sums != sums[0]).any()):
        raise ValueError(f"k_bits rows must sum to the same bits per head; got {sums.tolist()}")
    total = int(sums[0])
    return total, -(-total // 8)


@functools.lru_cache(maxsize=64)
def _uniform(d: int, bits: int) -> torch.Tensor:
    """[1, d] int64 widths, all `bits`: the fixed-width layout as per-channel widths."""
    return torch.full((1, d), bits, dtype=torch.int64)


def _cpu_lib(t: torch.Tensor):
    """The compiled CPU kernels when `t` is on CPU and they run (`kernels.cpu`), else None (the PyTorch ops)."""
    if t.device.type != "cpu":
        return None
    from kernels.cpu import _build  # here, not at import: kernels.cpu needs no part of this module

    return _build.lib()


def _compiled_pack(codes_NHD: torch.Tensor, widths_HD: torch.Tensor, pk: int) -> torch.Tensor | None:
    """[N, H, pk] uint8 by kernels/csrc/kv_bits.c (bit-identical to the PyTorch ops), or None where it cannot run."""
    lib = _cpu_lib(codes_NHD)
    if lib is None:
        return None
    n, h, d = codes_NHD.shape
    c, w = codes_NHD.to(torch.int64).contiguous(), widths_HD.to(torch.int64).contiguous()
    out = torch.empty(n, h, pk, dtype=torch.uint8)
    lib.moeray_pack_codes_var(c.data_ptr(), n, h, d, w.data_ptr(), pk, out.data_ptr())
    return out


def _compiled_unpack(packed_NHP: torch.Tensor, widths_HD: torch.Tensor) -> torch.Tensor | None:
    """[N, H, D] int64 codes by kernels/csrc/kv_bits.c, or None where it cannot run."""
    lib = _cpu_lib(packed_NHP)
    if lib is None or packed_NHP.dtype != torch.uint8:
        return None
    n, h, pk = packed_NHP.shape
    p, w = packed_NHP.contiguous(), widths_HD.to(torch.int64).contiguous()
    out = torch.empty(n, h, w.shape[1], dtype=torch.int64)
    lib.moeray_unpack_codes_var(p.data_ptr(), n, h, w.shape[1], w.data_ptr(), pk, out.data_ptr())
    return out


def _bit_mask(widths_HD: torch.Tensor) -> torch.Tensor:
    """[H, D, 8] bool: bit j of channel d's code is stored (j < width)."""
    j = torch.arange(MAX_CHANNEL_BITS, device=widths_HD.device)
    return j[None, None, :] < widths_HD.to(torch.int64)[..., None]


def pack_codes_var(codes: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Pack codes of per-channel widths: each (token, head) row is one little-endian bitstream, channel d at bit
    offset sum(widths[h, :d]), LSB first, zero-padded to whole bytes (same stream rule as `pack_codes`).

    Args:
        codes: [N, H, D] integer codes, 0 <= codes[..., h, d] < 2**widths[h, d].
        widths: [H, D] integer widths in [1, 8], every row with the same sum B.
    Returns:
        [N, H, ceil(B / 8)] uint8.
    Raises:
        ValueError: widths out of range or rows with different sums, or codes not [N, H, D].
    """
    total, pk = _check_widths(widths)
    n, h, d = codes.shape
    if widths.shape != (h, d):
        raise ValueError(f"codes.shape={tuple(codes.shape)} does not match widths.shape={tuple(widths.shape)}")
    fast = _compiled_pack(codes, widths, pk)
    if fast is not None:
        return fast
    shifts = torch.arange(MAX_CHANNEL_BITS, device=codes.device, dtype=torch.int32)
    bits = (codes.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [N, H, D, 8]
    stream = bits[:, _bit_mask(widths)].reshape(n, h, total)
    stream = torch.nn.functional.pad(stream, (0, pk * 8 - total)).reshape(n, h, pk, 8)
    return (stream << shifts).sum(-1).to(torch.uint8)


def unpack_codes_var(packed: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_codes_var`: [N, H, Pk] uint8 -> [N, H, D] int64 codes.

    Raises: ValueError for bad widths or packed.shape[-1] != ceil(B / 8).
    """
    total, pk = _check_widths(widths)
    n, h = packed.shape[:2]
    if packed.dim() != 3 or packed.shape[2] != pk or widths.shape[0] != h:
        raise ValueError(f"packed.shape={tuple(packed.shape)} must be [N, H={widths.shape[0]}, Pk={pk}]")
    fast = _compiled_unpack(packed, widths)
    if fast is not None:
        return fast
    shifts = torch.arange(MAX_CHANNEL_BITS, device=packed.device, dtype=torch.int32)
    stream = ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1).reshape(n, h, pk * 8)[..., :total]
    mask = _bit_mask(widths)
    bits = torch.zeros(n, *mask.shape, dtype=torch.int32, device=packed.device)
    bits[:, mask] = stream.reshape(n, -1)
    return (bits << shifts).sum(-1).to(torch.int64)


def channel_bit_offsets(widths: torch.Tensor) -> torch.Tensor:
    """[H, D] int32 bit offset of each channel's code within its head row (exclusive prefix sum of widths)."""
    w = widths.to(torch.int32)
    return (torch.cumsum(w, dim=1) - w).to(torch.int32)
