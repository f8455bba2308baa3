"""ICL word-pair tasks: data files, splits, prompt template, filters and top-k accuracy."""

from __future__ import annotations

import json
from collections import Counter
from importlib import resources

import pytest
import torch
from helpers import arch_or_hooked, bridge_model

from ra_lens import tasks
from ra_lens.tasks import Prompt, Task
from ra_lens.toy_models import tiny_model

REQUIRED = {
    "antonym",
    "country-capital",
    "english-french",
    "present-past",
    "singular-plural",
    "capitalize",
}
MIN_PAIRS = 100


@pytest.fixture(scope="module")
def model():
    return tiny_model(arch_or_hooked("gpt2"))


def _pairs(n: int) -> list[tuple[str, str]]:
    return [(f"x{i}", f"y{i}") for i in range(n)]


# --- data -------------------------------------------------------------------------------------


def test_available_lists_every_json_file():
    names = tasks.available()
    assert REQUIRED <= set(names)
    assert names == sorted(names)
    files = resources.files("ra_lens.tasks").joinpath("data")
    assert sorted(f.name for f in files.iterdir() if f.name.endswith(".json")) == [
        f"{n}.json" for n in names
    ]


@pytest.mark.parametrize("name", tasks.available())
def test_task_file_is_well_formed(name):
    raw = json.loads(
        resources.files("ra_lens.tasks").joinpath(f"data/{name}.json").read_text("utf-8")
    )
    assert set(raw) == {"name", "description", "pairs"}
    assert raw["name"] == name and raw["description"]
    task = tasks.load(name)
    assert task.name == name and len(task) >= MIN_PAIRS
    inputs = [x for x, _ in task.pairs]
    assert not [x for x, c in Counter(inputs).items() if c > 1], "duplicate inputs"
    for x, y in task.pairs:
        assert x and y and x == x.strip() and y == y.strip(), (x, y)
        assert "\n" not in x + y
        if name != "country-capital":  # city-states: Monaco -> Monaco
            assert x != y, f"trivial pair {x!r}"


def test_task_specific_conventions():
    for x, y in tasks.load("capitalize").pairs:
        assert x.islower() and x.isalpha() and y == x[0].upper() + x[1:]
    for name in ("antonym", "english-french", "present-past", "singular-plural", "synonym"):
        for x, y in tasks.load(name).pairs:
            assert x == x.lower() and y == y.lower() and " " not in x + y, (name, x, y)
    capitals = dict(tasks.load("country-capital").pairs)
    assert capitals["France"] == "Paris" and capitals["Japan"] == "Tokyo"
    assert len(capitals) >= 150


def test_load_is_cached_and_immutable():
    task = tasks.load("antonym")
    assert tasks.load("antonym") is task
    assert isinstance(task.pairs, tuple) and isinstance(task.pairs[0], tuple)
    assert ("hot", "cold") in task.pairs


def test_unknown_task_lists_available():
    with pytest.raises(ValueError, match="unknown task 'nope'") as err:
        tasks.load("nope")
    for name in tasks.available():
        assert name in str(err.value)


def test_task_rejects_malformed_pairs():
    with pytest.raises(TypeError, match="item 1"):
        Task("bad", [("a", "b"), ("c",)])
    with pytest.raises(TypeError):
        Task("bad", ["ab"])


# --- splits -----------------------------------------------------------------------------------


def test_split_sizes_70_21_9():
    splits = Task("t", _pairs(100)).split()
    assert splits.sizes() == {"train": 70, "test": 21, "valid": 9}
    for name in tasks.available():
        task = tasks.load(name)
        sizes = task.split().sizes()
        assert sum(sizes.values()) == len(task)
        assert sizes["train"] == round(0.7 * len(task))
        assert sizes["test"] == round(0.21 * len(task))


def test_split_deterministic_and_disjoint():
    task = tasks.load("country-capital")
    a, b = task.split(seed=42), task.split(seed=42)
    assert a == b
    assert task.split(seed=7).train != a.train
    train, test, valid = set(a.train), set(a.test), set(a.valid)
    assert not (train & test or train & valid or test & valid)
    assert train | test | valid == set(task.pairs)
    # shuffled, not just cut in file order
    assert list(a.train) != list(task.pairs[: len(a.train)])


def test_split_too_few_pairs():
    with pytest.raises(ValueError, match="too few"):
        Task("tiny", _pairs(5)).split()
    assert Task("ten", _pairs(10)).split().sizes() == {"train": 7, "test": 2, "valid": 1}


# --- prompts ----------------------------------------------------------------------------------


def test_two_shot_template_exact():
    demos = [("hot", "cold"), ("big", "small")]
    prompts = tasks.build_prompts(demos + [("up", "down")], [("up", "down")], shots=2, seed=0)
    (prompt,) = prompts
    assert prompt.query == "up" and prompt.answer == " down" and prompt.shots == 2
    expected = {
        "Q: hot\nA: cold\n\nQ: big\nA: small\n\nQ: up\nA:",
        "Q: big\nA: small\n\nQ: hot\nA: cold\n\nQ: up\nA:",
    }
    assert prompt.text in expected
    assert prompt.text == tasks.format_prompt(prompt.demos, "up")
    assert tasks.format_prompt(demos, "up") == "Q: hot\nA: cold\n\nQ: big\nA: small\n\nQ: up\nA:"
    assert tasks.format_prompt([], "up") == "Q: up\nA:"


def test_zero_shot_and_defaults_from_task():
    task = tasks.load("antonym")
    splits = task.split()
    prompts = tasks.build_prompts(task)
    assert [p.query for p in prompts] == [x for x, _ in splits.test]
    assert all(p.text == f"Q: {p.query}\nA:" and p.demos == () for p in prompts)
    five = tasks.build_prompts(task, shots=5)
    train = set(splits.train)
    assert all(len(p.demos) == 5 and set(p.demos) <= train for p in five)


def test_demos_never_contain_query_and_are_seeded():
    task = tasks.load("present-past")
    pool = task.pairs  # the queries are in the pool on purpose
    prompts = tasks.build_prompts(task, pool, shots=10, demos_from=pool, seed=3)
    for p in prompts:
        assert p.query not in [x for x, _ in p.demos]
        assert len(set(p.demos)) == 10
        assert f"Q: {p.query}\n" not in p.text[: -len(f"Q: {p.query}\nA:")]
    again = tasks.build_prompts(task, pool, shots=10, demos_from=pool, seed=3)
    assert again == prompts
    other = tasks.build_prompts(task, pool, shots=10, demos_from=pool, seed=4)
    assert other != prompts


def test_too_few_demos():
    pairs = _pairs(4)
    tasks.build_prompts(pairs, shots=3)  # 3 others besides each query: fine
    with pytest.raises(ValueError, match="needs 4 demonstrations"):
        tasks.build_prompts(pairs, shots=4)
    with pytest.raises(ValueError, match="shots"):
        tasks.build_prompts(pairs, shots=-1)


# --- tokenizer filters --------------------------------------------------------------------


def test_single_token_pairs(model):
    # The tiny BPE has " the" and " of" as single tokens; " cold" and " Florence" are split.
    assert model.to_tokens(" cold", prepend_bos=False).shape[1] > 1
    pairs = [("a", "the"), ("b", "cold"), ("c", "of"), ("d", "Florence")]
    assert tasks.single_token_pairs(model, pairs) == [("a", "the"), ("c", "of")]
    assert tasks.answer_token(model, " the") == model.to_tokens(" the", prepend_bos=False)[0, 0]
    task = Task("t", pairs)
    assert tasks.single_token_pairs(model, task) == [("a", "the"), ("c", "of")]


def test_same_length(model):
    words = ["the", "of", "is", "and", "to", "quick brown", "Italy", "France", "a", "hot"]
    prompts = tasks.build_prompts([(w, "the") for w in words], shots=0)
    lengths = tasks.prompt_lengths(model, prompts)
    assert lengths == [model.to_tokens(p.text).shape[1] for p in prompts]
    counts = Counter(lengths)
    assert len(counts) > 1
    mode = min(counts, key=lambda n: (-counts[n], n))  # most common, ties to the shorter
    kept = tasks.same_length(model, prompts)
    assert kept == [p for p, n in zip(prompts, lengths, strict=True) if n == mode]
    assert len({model.to_tokens(p.text).shape[1] for p in kept}) == 1
    longest = max(lengths)
    assert tasks.same_length(model, prompts, length=longest) == [
        p for p, n in zip(prompts, lengths, strict=True) if n == longest
    ]
    assert tasks.same_length(model, []) == []
    tie = tasks.build_prompts([(w, "the") for w in ["Italy", "the", "France", "of"]], shots=0)
    assert tasks.prompt_lengths(model, tie) == [8, 7, 8, 7]
    assert [p.query for p in tasks.same_length(model, tie)] == ["the", "of"]


# --- evaluation -------------------------------------------------------------------------------


def _mixed_prompts(n_shots: int = 1) -> list[Prompt]:
    """Prompts of different token lengths (different queries and demos)."""
    task = tasks.load("antonym")
    splits = task.split()
    return tasks.build_prompts(task, splits.test[:9], shots=n_shots, demos_from=splits.train)


@pytest.mark.tl4  # rigs the logits at unembed.hook_out, which HookedTransformer lacks
def test_evaluate_known_logits_via_hook(model):
    """Replace the logits by a pattern whose ranks are known exactly at every position."""
    vocab = model.cfg.d_vocab

    def known_logits(logits, hook):
        pos = torch.arange(logits.shape[1])[:, None]
        token = torch.arange(vocab)[None, :]
        pattern = -((token + 7 * pos) % vocab).float()  # rank of token t at pos p: (t + 7p) % V
        return pattern.expand_as(logits).to(logits)

    prompts = _mixed_prompts()
    lengths = tasks.prompt_lengths(model, prompts)
    assert len(set(lengths)) > 1
    expected = torch.tensor(
        [
            (tasks.answer_token(model, p.answer) + 7 * (n - 1)) % vocab
            for p, n in zip(prompts, lengths, strict=True)
        ]
    )
    acc = tasks.evaluate(
        model, prompts, fwd_hooks=[("unembed.hook_out", known_logits)], batch_size=4
    )
    assert torch.equal(acc.ranks, expected)
    assert acc.n == len(prompts)
    for k in (1, 2, 3):
        assert getattr(acc, f"top{k}") == pytest.approx(float((expected < k).float().mean()))


@pytest.mark.tl4  # rigs the logits at unembed.hook_out, which HookedTransformer lacks
def test_evaluate_topk_fractions(model):
    """Make the answer rank 0, 1, 2 or 5 on purpose and check the top-k fractions."""
    prompts = _mixed_prompts()[:4]
    wanted = [0, 1, 2, 5]
    answers = [tasks.answer_token(model, p.answer) for p in prompts]
    lengths = tasks.prompt_lengths(model, prompts)

    def rigged(logits, hook):
        out = torch.zeros_like(logits)
        out[..., :10] = torch.arange(10, 0, -1).to(logits)  # tokens 0..9 rank 0..9
        for row, (tok, rank, n) in enumerate(zip(answers, wanted, lengths, strict=True)):
            out[row, n - 1, tok] = 10 - rank + 0.5  # strictly between two of the top ten
        return out

    # all prompts in one batch, so row i is prompt i
    acc = tasks.evaluate(model, prompts, fwd_hooks=[("unembed.hook_out", rigged)], batch_size=4)
    assert acc.ranks.tolist() == wanted
    assert (acc.top1, acc.top2, acc.top3) == (0.25, 0.5, 0.75)
    assert acc.top(6) == 1.0
    d = tasks.evaluate(
        model, prompts, fwd_hooks=[("unembed.hook_out", rigged)], batch_size=4, ks=(1, 5, 6)
    ).to_dict()
    assert d == {"n": 4, "top1": 0.25, "top2": 0.5, "top3": 0.75, "top5": 0.75, "top6": 1.0}


def _brute_force_ranks(model, prompts: list[Prompt]) -> list[int]:
    """One prompt at a time, no padding: rank of the answer token at the last position."""
    brute = []
    with torch.no_grad():
        for p in prompts:
            logits = model(model.to_tokens(p.text))[0, -1]
            target = logits[tasks.answer_token(model, p.answer)]
            brute.append(int((logits > target).sum()))
    return brute


def test_evaluate_matches_brute_force_and_padding(model):
    prompts = _mixed_prompts(n_shots=2)
    assert len(set(tasks.prompt_lengths(model, prompts))) > 1
    brute = _brute_force_ranks(model, prompts)
    padded = tasks.evaluate(model, prompts, batch_size=5)
    single = tasks.evaluate(model, prompts, batch_size=1)
    assert padded.ranks.tolist() == brute
    assert torch.equal(single.ranks, padded.ranks)
    assert padded.ranks.dtype == torch.long and padded.ranks.shape == (len(prompts),)
    # no hook is left behind by evaluate
    assert all(not h.fwd_hooks for h in model.hook_dict.values() if hasattr(h, "fwd_hooks"))


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_evaluate_padding_other_architectures(arch):
    other = bridge_model(arch)
    prompts = _mixed_prompts(n_shots=2)
    assert tasks.evaluate(other, prompts, batch_size=5).ranks.tolist() == _brute_force_ranks(
        other, prompts
    )


def test_evaluate_hooks_are_applied_and_removed(model):
    prompts = _mixed_prompts()[:3]
    calls = []

    def spy(act, hook):
        calls.append(act.shape[0])
        return act

    base = tasks.evaluate(model, prompts)
    hooked = tasks.evaluate(
        model, prompts, fwd_hooks=[("blocks.0.hook_resid_pre", spy)], batch_size=2
    )
    assert calls == [2, 1]
    assert torch.equal(base.ranks, hooked.ranks)
    tasks.evaluate(model, prompts)
    assert calls == [2, 1]


def test_answer_ranks_reads_each_last_position_and_handles_nan():
    logits = torch.zeros(2, 3, 5)
    logits[0, 1] = torch.tensor([0.0, 4.0, 3.0, 2.0, 1.0])  # row 0 ends at position 1
    logits[1, 2] = torch.tensor([5.0, 4.0, 3.0, float("nan"), 1.0])  # row 1 ends at position 2
    ranks = tasks.answer_ranks(logits, torch.tensor([2, 3]), torch.tensor([2, 3]))
    assert ranks.tolist() == [1, 4]  # NaN answer logit: worst rank, never a false top-1


def test_evaluate_rejects_bad_input(model):
    with pytest.raises(ValueError, match="no prompts"):
        tasks.evaluate(model, [])
    with pytest.raises(ValueError, match="batch_size"):
        tasks.evaluate(model, _mixed_prompts()[:1], batch_size=0)
