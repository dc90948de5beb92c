"""apply_rope's inverse frequencies are made once per (device, attributes): the same rotation as computing them on
every call (the oracle: the formula written out here with a fresh rope_inv_freq)."""

import torch

from deepinfer.ir.ops import attention as att

ATTRS = {"rope_dim": 64, "theta": 160000.0, "yarn_factor": 16.0, "yarn_orig_len": 65536, "beta_fast": 32.0,
         "beta_slow": 1.0}  # fmt: skip


def _fresh(x, positions, inverse):
    freq = att.rope_inv_freq(*ATTRS.values())
    angle = positions.float().unsqueeze(-1) * freq
    angle = angle.reshape(angle.shape[:1] + (1,) * (x.dim() - 2) + angle.shape[1:])
    cos, sin = angle.cos(), -angle.sin() if inverse else angle.sin()
    rot = x[..., -64:].float()
    even, odd = rot[..., 0::2], rot[..., 1::2]
    out = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-64], out.to(x.dtype)], dim=-1)


def test_cached_frequencies_give_the_same_rotation():
    x, pos = torch.randn(5, 3, 128), torch.tensor([0, 7, 4096, 65535, 100000])
    for inverse in (False, True):
        for _ in range(2):  # the second call reads the cache
            assert torch.equal(att.apply_rope(x, pos, inverse=inverse, **ATTRS), _fresh(x, pos, inverse))
    assert ("cpu", *ATTRS.values()) in att._INV_FREQ
