"""The GPU benchmark's honest PyTorch peer (bench/peers/model_cuda_peer.py --peer honest, its mixers
in bench/peers/fast_mixers.py) computes the same model as the reference peer: loss and every
gradient from the same float64 weights, on the CPU, eagerly (the compiled variant runs the same
functions through torch.compile: `model_cuda_peer.py --verify --device cpu`, 36 s here, not in CI).
And the check fails when the peer's arithmetic is off by 0.1% in one term."""
import argparse
import os
import sys

import pytest

torch = pytest.importorskip("torch")
PEERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "peers")
sys.path.insert(0, PEERS)
import fast_mixers  # noqa: E402
import model_cuda_peer  # noqa: E402


def verify_args():
    return argparse.Namespace(device="cpu", no_compile=True, width=64, heads=2, layers="ttt,attn,mamba,attn",
                              verify_seq=48, checkpoint=False)


def test_honest_peer_is_the_reference_model(capsys):
    assert model_cuda_peer.verify(verify_args()) == 0
    out = capsys.readouterr().out
    assert "Mamba by associative_scan" in out and ": ok" in out, out


def test_verify_catches_a_wrong_term(monkeypatch, capsys):
    scan = fast_mixers.selective_scan_assoc

    def off(u, delta, A, B, C, D, z, delta_bias):  # the skip term D·u 0.1% low
        return scan(u, delta, A, B, C, D * 0.999, z, delta_bias)

    monkeypatch.setattr(fast_mixers, "selective_scan_assoc", off)
    assert model_cuda_peer.verify(verify_args()) == 1
    assert "FAIL" in capsys.readouterr().out
