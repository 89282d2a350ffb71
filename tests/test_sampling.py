"""A seed that holds: a sampled request's tokens are a function of its prompt, parameters and seed
alone, whether it runs alone, in a batch call, or beside other concurrent jobs (tiny Qwen2-VL, CPU)."""

from __future__ import annotations

import asyncio

import pytest
import torch

import handler
from runpod_vlm.engine.sampling import counter_uniform


@pytest.fixture
def engine(tiny_model, serve):
    return serve(tiny_model("qwen2-vl"))


def chat(text: str, **sampling) -> dict:
    return {
        "messages": [{"role": "user", "content": text}],
        "max_new_tokens": 12,
        "min_new_tokens": 12,
        "do_sample": True,
        "temperature": 1.5,
        **sampling,
    }


def ask(payload: dict) -> dict:
    return asyncio.run(handler.local_test_answer({"id": "sampled", "input": payload}))


def test_the_same_seed_gives_the_same_tokens_alone_and_in_a_batch(engine):
    seeded = chat("Tell me a story.", seed=1234)
    alone = ask(seeded)["response"]
    assert ask(seeded)["response"] == alone
    neighbours = [chat("Something else.", temperature=0.7, top_p=0.9), chat("More.", seed=99), chat("Greedy.")]
    neighbours[-1].update(do_sample=False, temperature=0.0)
    for place in range(len(neighbours) + 1):
        batch = [*neighbours[:place], seeded, *neighbours[place:]]
        assert ask({"requests": batch})["results"][place]["response"] == alone, place


def test_the_same_seed_gives_the_same_tokens_beside_concurrent_jobs(engine):
    seeded = chat("Tell me a story.", seed=7)
    alone = ask(seeded)["response"]

    async def together():
        jobs = [chat(f"Job {n}.", temperature=1.0 + n / 10) for n in range(5)]
        jobs.insert(2, seeded)
        return await asyncio.gather(
            *(handler.local_test_answer({"id": str(n), "input": job}) for n, job in enumerate(jobs))
        )

    assert asyncio.run(together())[2]["response"] == alone


def test_different_seeds_draw_different_tokens(engine):
    answers = {ask(chat("Tell me a story.", seed=seed))["response"] for seed in (1, 2, 3)}
    assert len(answers) == 3
    # Seeds equal in their low 31 or 32 bits, or in their high half, draw differently: all 64 bits count.
    wide = [5, 5 + 2**31, 5 + 2**32, 5 - 2**63, 2**63 - 1, -1]
    answers = [ask(chat("Tell me a story.", seed=seed))["response"] for seed in wide]
    assert len(set(answers)) == len(wide), answers
    assert ask(chat("Tell me a story.", seed=5 - 2**63))["response"] == answers[3]  # and each holds
    unseeded = {ask(chat("Tell me a story."))["response"] for _ in range(2)}
    assert len(unseeded) == 2  # no seed: a fresh one each time


def test_the_openai_route_seed_is_the_native_seed(engine):
    from runpod_vlm.openai_route import openai_answers

    body = {"messages": [{"role": "user", "content": "Hi"}], "seed": 5, "max_tokens": 8, "temperature": 1.2}

    async def completion():
        job = {"openai_route": "/v1/chat/completions", "openai_input": body}
        return [answer async for answer in openai_answers(handler.get_engine, handler.served_model, job)][0]

    native = ask({"messages": body["messages"], "seed": 5, "max_new_tokens": 8, "temperature": 1.2, "do_sample": True})
    assert asyncio.run(completion())["choices"][0]["message"]["content"] == native["response"]


def test_counter_noise_is_uniform_and_depends_on_the_row_alone():
    seeds, steps = torch.tensor([3, 3, 4, 9]), torch.tensor([0, 1, 0, 0])
    draws = counter_uniform(seeds, steps, torch.arange(50_000))
    assert 0 < draws.min() and draws.max() < 1
    assert abs(draws.mean().item() - 0.5) < 0.01 and abs(draws.var().item() - 1 / 12) < 0.002
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    reordered = counter_uniform(seeds.flip(0), steps.flip(0), torch.arange(50_000))
    assert torch.equal(reordered.flip(0), draws)  # a row's draws do not depend on its neighbours
    assert torch.corrcoef(torch.stack([draws[0], draws[2]]))[0, 1].abs() < 0.05


def test_sampling_draws_within_each_rows_nucleus_as_argmax_of_p_over_exponential_noise():
    """Each row's draw: among the tokens whose more likely ones hold at most its top_p, the argmax of p / Exp(1)
    with Exp(1) = -log(its counter noise); the sampler's in-place steps, on groups of rows, give exactly that."""
    import types

    from runpod_vlm.engine.sampling import SAMPLED_TOGETHER, Sampler

    rows, vocab = 160, 1000
    assert rows > 2 * SAMPLED_TOGETHER and rows % SAMPLED_TOGETHER
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    state = types.SimpleNamespace(
        temperature=torch.rand(rows, generator=generator) + 0.3,
        top_p=torch.tensor([0.0, 1.0, 0.5, 0.9] * (rows // 4)),
        seed=torch.arange(rows) * 7919,
        count=torch.arange(rows) % 5,
    )
    sampler = Sampler.__new__(Sampler)
    sampler.vocab_index = torch.arange(vocab)
    drawn = sampler.sampled(logits.clone(), state)

    probs = torch.softmax(logits / state.temperature[:, None], dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    kept = ((sorted_probs.cumsum(dim=-1) - sorted_probs) <= state.top_p[:, None]) | (state.top_p[:, None] >= 1)
    nucleus = torch.zeros_like(kept).scatter(1, order, kept)
    exponential = -torch.log(counter_uniform(state.seed, state.count, sampler.vocab_index))
    expected = torch.where(nucleus, probs / exponential, torch.zeros_like(probs)).argmax(dim=-1)
    assert torch.equal(drawn, expected)
    assert nucleus.gather(1, drawn[:, None]).all()
    assert torch.equal(drawn[state.top_p == 0], probs.argmax(dim=-1)[state.top_p == 0])  # top_p 0: greedy
    assert (drawn != probs.argmax(dim=-1)).sum() > rows // 8  # the others do sample


def test_rows_whose_top_p_is_1_draw_the_same_without_the_sort_and_keep_every_token(monkeypatch):
    """No row's top_p below 1: the vocabulary is not sorted, and each row draws what it draws beside a top_p row
    (then sorted), every token kept: a top_p of 1 masks nothing, even where the float cumulative sum passes 1."""
    import types

    from runpod_vlm.engine.sampling import Sampler

    rows, vocab = 8, 5000
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(rows, vocab, generator=generator) * 3  # the float cumulative sum passes 1 before the tail
    state = types.SimpleNamespace(
        temperature=torch.ones(rows),
        top_p=torch.ones(rows),
        seed=torch.arange(rows) * 31,
        count=torch.zeros(rows, dtype=torch.long),
    )
    sampler = Sampler.__new__(Sampler)
    sampler.vocab_index = torch.arange(vocab)
    sorted_once = []
    sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda *a, **k: sorted_once.append(1) or sort(*a, **k))
    unsorted = sampler.sampled(logits.clone(), state, top_p=False)
    assert not sorted_once
    masked = []
    fill = torch.Tensor.masked_fill_
    monkeypatch.setattr(torch.Tensor, "masked_fill_", lambda t, m, v: masked.append(int(m.sum())) or fill(t, m, v))
    beside = sampler.sampled(logits.clone(), state, top_p=True)
    assert sorted_once and torch.equal(unsorted, beside) and masked == [0]
    ordered = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)[0]
    assert (ordered.cumsum(dim=-1) - ordered > 1).any()  # where `before > top_p` alone would have masked some
    probs = torch.softmax(logits, dim=-1)
    exponential = -torch.log(counter_uniform(state.seed, state.count, sampler.vocab_index))
    assert torch.equal(unsorted, (probs / exponential).argmax(dim=-1))  # no token masked


def test_a_decoder_row_flags_its_top_p_only_when_it_samples_below_1():
    from runpod_vlm.engine.decoder import row_flags
    from runpod_vlm.vocabulary import GenerationParams

    assert row_flags(GenerationParams(8, 0.7, 0.9, True))[3]
    assert not row_flags(GenerationParams(8, 0.7, 1.0, True))[3]
    assert not row_flags(GenerationParams(8, 0.0, 0.5, False))[3]  # greedy: its top_p is not read


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, int("9" * 4000)], ids=["2^63", "-2^63-1", "4000 digits"])
def test_a_seed_outside_int64_is_refused_naming_it(engine, seed):
    refused = ask(chat("Hi.", seed=seed))
    assert refused["code"] == "invalid_request" and refused["param"] == "seed", refused
