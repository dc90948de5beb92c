"""Symbolic dims: normalisation, text round trip, evaluation, exact division."""

import pytest

from deepinfer.errors import IRError, ShapeError
from deepinfer.ir.shapes import (
    add,
    broadcast_shapes,
    dim_str,
    dmin,
    evaluate,
    exact_div,
    mul,
    parse_dim,
    substitute,
    sym,
)

T, S = sym("T"), sym("S")


@pytest.mark.parametrize(
    "expr, text",
    [
        (T // 4, "T//4"),
        (2 * T + 1, "2*T+1"),
        ((4 * T) // 4, "T"),
        (T * 2, "2*T"),
        (2 * (T + 1), "2*T+2"),
        (T - 1, "T-1"),
        ((T + 3) // 4, "(T+3)//4"),
        (dmin(T, 512), "min(512, T)"),
        (S + T + 1, "S+T+1"),
        (T % 4, "T%4"),
        (T + T, "2*T"),
        (T - T, "0"),
    ],
)
def test_normal_form_and_text_round_trip(expr, text):
    assert dim_str(expr) == text
    assert parse_dim(text) == expr


def test_commutativity_is_normalised():
    assert mul(T, S) == mul(S, T)
    assert add(T, S, 3) == add(3, S, T)


def test_evaluate_and_substitute():
    e = (T + 3) // 4 * 2 + S
    assert evaluate(e, {"T": 13, "S": 5}) == (13 + 3) // 4 * 2 + 5
    assert substitute(T // 4, {"T": 17}) == 4
    assert substitute(T // 4, {"T": 4 * S}) == S
    with pytest.raises(ShapeError, match="symbol T is not bound"):
        evaluate(T, {})


def test_exact_div_for_reshape_inference():
    assert exact_div(mul(T, 4096), mul(T, 32)) == 128
    assert exact_div(mul(T, 512), 64) == 8 * T
    assert exact_div(T + 1, T) is None
    assert exact_div(mul(T, 3), 2) is None


def test_broadcast():
    assert broadcast_shapes((T, 1, 4), (5, 1)) == (T, 5, 4)
    assert broadcast_shapes((T, 4), (S, 4)) is None


def test_bad_dim_text():
    with pytest.raises(IRError, match="bad dimension"):
        parse_dim("T +* 2")
    with pytest.raises(IRError, match="bad dimension"):
        parse_dim("foo(T)")
