"""sparse_attn_decode's decode switches (UNSPLIT_MIN_B, SPLIT_PARTIAL_BF16, DECODE_L2_PREFETCH, DECODE_O_SMEM, ...):
the measured defaults give sm90_config's measured choices, and each switch changes only the configs it names (so
flipping one after the H200 rows of `kernels_h200.py --only "sparse_attn s7"` is a one-line change with a known
reach)."""

import dataclasses

import pytest

from deepinfer.codegen.kernels import sparse_attn_decode as sad

BATCHES = (1, 8, 16, 64, 128, 256, 1024)


def _configs(fp8: bool = False) -> dict:
    return {b: sad.sm90_config(b, 640, fp8=fp8) for b in BATCHES}


def test_defaults_keep_the_measured_choices():
    got = {b: c.tag for b, c in _configs().items()}
    # session 9: o_smem on the one-pass configs, B64 unsplit (H200 call 3); session 10: evict_first from B128 (call 2),
    # q_regs at B64 .. 127 (call 3)
    assert got[64] == "wsn64s2or" and got[128] == "wsn64s2of" and got[256] == "wsn64s2p132of", got
    assert _configs(fp8=True)[64].num_split > 1 and not any(c.o_smem for c in _configs(fp8=True).values())
    assert not any(c.partial_bf16 or c.l2_prefetch for c in _configs().values())


def test_partial_bf16_switch_reaches_split_configs_only(monkeypatch):
    before = _configs()
    monkeypatch.setattr(sad, "SPLIT_PARTIAL_BF16", True)
    after = _configs()
    for b in BATCHES:
        want = dataclasses.replace(before[b], partial_bf16=True) if before[b].num_split > 1 else before[b]
        assert after[b] == want, (b, after[b].tag)
    assert after[16].num_split > 1 and after[16].partial_bf16 and not after[64].partial_bf16
    assert not any(c.partial_bf16 for c in _configs(fp8=True).values())  # FP8 KV: the switch is bf16-only


def test_l2_prefetch_switch_reaches_the_single_pass_only(monkeypatch):
    before = _configs()
    monkeypatch.setattr(sad, "DECODE_L2_PREFETCH", 1)
    after = _configs()
    for b in BATCHES:
        single = before[b].num_split == 1 and not before[b].persist  # persist takes no prefetch (Config check)
        assert after[b] == (dataclasses.replace(before[b], l2_prefetch=1) if single else before[b]), b
    assert after[128].tag == "wsn64s2pf1of" and after[256].persist


def test_unsplit_switch_reaches_b64_and_up_only(monkeypatch):
    before = _configs()
    assert before[64].num_split == 1 and before[64].tag == "wsn64s2or"
    monkeypatch.setattr(sad, "UNSPLIT_MIN_B", 0)  # the previous rule: B64 splits in 2 (fp32 partials, no o_smem)
    after = _configs()
    assert after[64].num_split == 2 and after[64].tag == "wsn64s2x2"
    assert all(after[b] == before[b] for b in BATCHES if b != 64), {b: after[b].tag for b in BATCHES}


def test_env_form_sets_the_switches(monkeypatch):
    for name in sad.DECODE_SWITCHES:  # restored after the test
        monkeypatch.setattr(sad, name, getattr(sad, name))
    sad.apply_decode_switches("UNSPLIT_MIN_B=64, PERSIST_MIN_B=0,SPLIT_PARTIAL_BF16=1")
    assert (sad.UNSPLIT_MIN_B, sad.PERSIST_MIN_B, sad.SPLIT_PARTIAL_BF16) == (64, 0, True)
    assert sad.sm90_config(64, 640).tag == "wsn64s2or" and sad.sm90_config(256, 640).tag == "wsn64s2of"
    assert sad.sm90_config(16, 640).partial_bf16
    with pytest.raises(ValueError, match="not one of"):
        sad.apply_decode_switches("PERSIST=0")


def test_o_smem_switch_reaches_the_one_pass_bf16_configs(monkeypatch):
    """DECODE_O_SMEM (session 9, on): Config.o_smem on the single pass and the persistent grid (64-row blocks), not
    on the split passes nor on FP8 KV; 0 takes it off everywhere."""
    after = _configs()
    monkeypatch.setattr(sad, "DECODE_O_SMEM", 0)
    before, before8 = _configs(), _configs(fp8=True)
    assert not any(c.o_smem for c in before.values())
    for b in BATCHES:
        fits = before[b].num_split == 1 and before[b].block_n == 64
        assert after[b] == dataclasses.replace(before[b], o_smem=fits), (b, after[b].tag)
    assert after[128].tag == "wsn64s2of" and after[256].tag == "wsn64s2p132of" and not after[16].o_smem
    assert _configs(fp8=True) == before8 and not any(c.o_smem for c in before8.values())


def test_evict_first_from_b128_on_bf16_decode_only(monkeypatch):
    """EVICT_FIRST_MIN_B (session 10: 128, H200 call 2): Config.evict_first on the bf16 decode configs of >= 128
    requests (single pass, persistent grid) and nothing else -- no smaller batch, no FP8-KV config, never prefill (a
    chunk's tokens re-read their pools from L2); 0 takes it off, 1 puts it on every bf16 decode config."""
    on = _configs()
    assert {b for b, c in on.items() if c.evict_first} == {b for b in BATCHES if b >= 128}
    assert not any(c.evict_first for c in _configs(fp8=True).values()) and not sad.prefill_config(8192, 640).evict_first
    monkeypatch.setattr(sad, "EVICT_FIRST_MIN_B", 0)
    off = _configs()
    assert not any(c.evict_first for c in off.values())
    assert all(on[b] == dataclasses.replace(off[b], evict_first=b >= 128) for b in BATCHES)
    monkeypatch.setattr(sad, "EVICT_FIRST_MIN_B", 1)
    assert all(c == dataclasses.replace(off[b], evict_first=True) for b, c in _configs().items())
    assert _configs()[16].num_split > 1 and _configs()[16].evict_first  # a split pass too


def test_q_regs_from_64_to_127_requests_only(monkeypatch):
    """Q_REGS_MIN_B .. Q_REGS_MAX_B (session 10: 64 .. 127, H200 call 3): Config.q_regs on the bf16 decode configs of
    that many requests only (B64 unsplit), not the splits below nor the evict_first configs above, no FP8-KV one, never
    prefill; 0 takes it off."""
    on = _configs()
    assert {b for b, c in on.items() if c.q_regs} == {64}
    assert not any(c.q_regs for c in _configs(fp8=True).values()) and not sad.prefill_config(8192, 640).q_regs
    monkeypatch.setattr(sad, "Q_REGS_MIN_B", 0)
    off = _configs()
    assert all(on[b] == dataclasses.replace(off[b], q_regs=b == 64) for b in BATCHES)
