"""The sampling benchmark's logic on a CPU (minitrain.tools.benchmarks.sample): the fp32 check that guards every
timing, the bf16 agreement, the decode rate's arithmetic, the best transformers a ratio is taken against, and a
whole tiny run."""

import collections

import pytest
import torch

from minitrain import generate
from minitrain.tools.benchmarks import sample

CPU = torch.device("cpu")
PROMPT = 16


def test_the_fp32_check_passes_when_the_imported_model_decodes_transformers_tokens(capsys):
    sample.check_fp32("tiny", None, PROMPT, sample.CHECK_TOKENS, CPU)
    assert "check tiny fp32: 100% of 32 greedy tokens equal to transformers'" in capsys.readouterr().out


def test_the_fp32_check_refuses_a_decode_step_one_position_behind(monkeypatch):
    """A decode step fed the previous token's position (a plausible off-by-one in the cache's indexing)."""
    step = generate._decode
    monkeypatch.setattr(generate, "_decode", lambda model, cache, token, pos, s: step(model, cache, token, pos - 1, s))
    with pytest.raises(sample.DecodeMismatch, match="nothing timed"):
        sample.check_fp32("tiny", None, PROMPT, sample.CHECK_TOKENS, CPU)


def test_the_fp32_check_refuses_one_wrong_token_at_the_very_end(monkeypatch):
    """All tokens but one row's last: 63 of 64 agree, still not the same computation."""
    class LastTokenOff(sample.Minitrain):
        def __call__(self, prompt, n):
            tokens = super().__call__(prompt, n).clone()
            tokens[0, -1] += 1
            return tokens

    monkeypatch.setattr(sample, "Minitrain", LastTokenOff)
    with pytest.raises(sample.DecodeMismatch, match=r"\(98%, "):
        sample.check_fp32("tiny", None, PROMPT, sample.CHECK_TOKENS, CPU)


def test_the_fp32_check_refuses_agreeing_texts_of_too_few_distinct_tokens(monkeypatch):
    """Two sides that agree on a text of four tokens repeated have not shown that the cache works."""
    def cycling(*args):
        return lambda prompt, n: torch.cat([prompt, (torch.arange(n) % 4 + 7).expand(prompt.shape[0], n)], 1)

    monkeypatch.setattr(sample, "Minitrain", cycling)
    monkeypatch.setattr(sample, "Transformers", cycling)
    with pytest.raises(sample.DecodeMismatch, match="4 distinct"):
        sample.check_fp32("tiny", None, PROMPT, sample.CHECK_TOKENS, CPU)


def test_agreement_counts_each_rows_tokens_before_its_first_disagreement_only():
    a = torch.tensor([[1, 2, 5, 6, 7, 8]] * 3)
    b = torch.tensor([[1, 2, 5, 0, 7, 8],    # one token, then a disagreement (the later agreement does not count)
                      [1, 2, 0, 6, 7, 8],    # disagrees at the first new token: none
                      [1, 2, 5, 6, 7, 8]])   # all four
    assert sample.agreement(a, b, prompt_len=2) == pytest.approx((1 + 0 + 4) / 12)
    assert sample.agreement(a, a, prompt_len=2) == 1.0


def test_decode_rate_is_the_tokens_after_the_first_over_the_time_beyond_a_one_token_generate():
    assert sample.decode_tokens_per_s(batch=16, new_tokens=100, t_n=2.5, t_1=0.5) == 16 * 99 / 2.0


def test_a_cells_line_says_each_median_with_its_spread_the_ratio_and_the_agreement():
    row = {"model": "gpt2-124m", "batch": 1, "bf16_greedy_agreement": 0.025, "ratio_to_best_transformers": 3.656,
           "minitrain": {"median": 2039.4, "min": 2022.0, "max": 2040.2},
           "minitrain compiled step": {"median": 1500.2, "min": 1499.0, "max": 1510.0},
           "transformers static+compile": {"median": 558.0, "min": 555.0, "max": 572.0},
           "transformers eager": {"median": 94.0, "min": 93.0, "max": 96.0}}
    assert sample.cell_line(row) == (
        "gpt2-124m B=1: minitrain 2,039 (2,022-2,040), minitrain compiled step 1,500 (1,499-1,510), "
        "transformers static+compile 558 (555-572), transformers eager "
        "94 (93-96) tokens/s | 3.66x the best transformers | bf16 greedy agreement 2%")


# seconds per new token on the fake clock, by batch: the faster transformers is eager at batch 1, static at 2
PER_TOKEN = {1: {"minitrain": 1e-3, "minitrain compiled step": 1.5e-3, "transformers eager": 2e-3,
                 "transformers static+compile": 4e-3},
             2: {"minitrain": 1e-3, "minitrain compiled step": 3e-3, "transformers eager": 4e-3,
                 "transformers static+compile": 2e-3}}


def test_a_tiny_run_checks_then_times_each_cell_by_the_same_arithmetic_against_the_faster_transformers(
        monkeypatch, capsys):
    """The run as `--device cpu --models tiny --check-model tiny --batches 1 2` makes it, on a clock where a new
    token costs PER_TOKEN after 0.5 s of prefill, and each round takes twice as long as the one before: tokens/s
    are batch / cost in the middle round, the spread the first and last rounds', and the ratio is against the
    faster transformers (eager at batch 1, static at batch 2)."""
    calls = collections.Counter()

    def fake_timed(fn, prompt, n):
        if isinstance(fn, sample.Minitrain):
            label = "minitrain" if fn.fused is None else "minitrain compiled step"
        else:
            label = "transformers eager" if fn.cache is None else "transformers static+compile"
        slowdown = 2 ** (calls[fn] // 2)  # two calls a round: N new tokens, then 1
        calls[fn] += 1
        return 0.5 + n * PER_TOKEN[prompt.shape[0]][label] * slowdown

    monkeypatch.setattr(sample, "timed", fake_timed)
    rows = sample.run(["tiny"], [1, 2], prompt_len=PROMPT, new_tokens=4, rounds=3, check_model="tiny", device=CPU)
    assert [(r["model"], r["batch"], r["prompt"], r["new_tokens"]) for r in rows] == [("tiny", 1, PROMPT, 4),
                                                                                      ("tiny", 2, PROMPT, 4)]
    for r in rows:
        assert set(r) == {"model", "batch", "prompt", "new_tokens", "bf16_greedy_agreement",
                          "ratio_to_best_transformers", *sample.IMPLEMENTATIONS}
        for label, per_token in PER_TOKEN[r["batch"]].items():
            rate = r["batch"] / per_token
            assert r[label] == {"median": pytest.approx(rate / 2), "min": pytest.approx(rate / 4),
                                "max": pytest.approx(rate)}, label
        assert r["ratio_to_best_transformers"] == pytest.approx(2.0)
    out = capsys.readouterr().out
    assert out.index("check tiny fp32: 100%") < out.index("tiny B=1: minitrain ") < out.index("tiny B=2: minitrain ")
