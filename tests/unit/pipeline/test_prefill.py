"""Target prefill: layer-id convention, batch invariance, last-hidden positions, batching."""
import numpy as np
import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.target_model.prefill import TargetPrefill, check_layer_ids, length_batches, next_supervised_positions


def _sample(rng, n, vocab=512):
    ids = rng.integers(6, vocab, size=n).astype(np.int32)
    mask = np.zeros(n, np.uint8)
    mask[n // 2:] = 1
    return ids, mask


def test_layer_ids_match_output_hidden_states(tiny_qwen3):
    rng = np.random.default_rng(0)
    ids, mask = _sample(rng, 20)
    pre = TargetPrefill(tiny_qwen3, [-1, 0, 1, 2])
    out = pre([ids], [mask])[0]
    with torch.no_grad():
        ref = tiny_qwen3(torch.as_tensor(ids[None], dtype=torch.long), output_hidden_states=True)
    hs = ref.hidden_states
    H = tiny_qwen3.config.hidden_size
    for j, k in enumerate([-1, 0, 1, 2]):  # id k = output of layer k = hidden_states[k + 1]
        torch.testing.assert_close(out.features[:, j * H:(j + 1) * H], hs[k + 1][0].to(torch.bfloat16))
    # last_hidden = the post-norm final state at positions whose next token is supervised
    pos = next_supervised_positions(mask)
    assert pos.tolist() == list(range(9, 19))
    torch.testing.assert_close(out.last_hidden, hs[-1][0, pos].to(torch.bfloat16))
    logits = tiny_qwen3.lm_head(out.last_hidden.float())
    torch.testing.assert_close(logits, ref.logits[0, pos], atol=0.05, rtol=0.05)


def test_final_layer_is_prenorm_and_refused(tiny_qwen3):
    """HF's last hidden state is after the final norm; the hooked final layer would be pre-norm."""
    rng = np.random.default_rng(1)
    ids, _ = _sample(rng, 12)
    captured = {}
    h = tiny_qwen3.model.layers[3].register_forward_hook(lambda m, i, o: captured.setdefault("pre", o))
    with torch.no_grad():
        hs = tiny_qwen3(torch.as_tensor(ids[None], dtype=torch.long), output_hidden_states=True).hidden_states
    h.remove()
    pre = captured["pre"][0] if isinstance(captured["pre"], tuple) else captured["pre"]
    torch.testing.assert_close(tiny_qwen3.model.norm(pre), hs[-1])
    assert not torch.allclose(pre, hs[-1], atol=1e-3)
    with pytest.raises(ConfigError, match="final layer 3 is refused"):
        TargetPrefill(tiny_qwen3, [0, 3])
    for bad in ([1, 1], [2, 0], [-2, 0], []):
        with pytest.raises(ConfigError):
            check_layer_ids(bad, 4)


def test_batch_invariance(tiny_qwen3):
    rng = np.random.default_rng(2)
    samples = [_sample(rng, n) for n in (7, 31, 16, 3 + 20, 11)]
    pre = TargetPrefill(tiny_qwen3, [0, 2])
    alone = [pre([i], [m])[0] for i, m in samples]
    order = [3, 0, 4, 1, 2]
    batched = pre([samples[i][0] for i in order], [samples[i][1] for i in order])
    for j, i in enumerate(order):
        a, b = alone[i], batched[j]
        assert a.features.shape == b.features.shape == (len(samples[i][0]), 128)
        # equal up to one bf16 rounding step of batched float32 kernels
        torch.testing.assert_close(b.features, a.features, atol=2e-2, rtol=2 ** -7)
        torch.testing.assert_close(b.last_hidden, a.last_hidden, atol=2e-2, rtol=2 ** -7)
        assert (b.features == a.features).float().mean() > 0.99


def test_length_batches_cap_and_cover():
    lengths = [5, 100, 7, 50, 50, 3, 60]
    batches = length_batches(lengths, 120)
    assert sorted(i for b in batches for i in b) == list(range(7))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 120
    assert batches == [[5, 0, 2], [3, 4], [6], [1]]
