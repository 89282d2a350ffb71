"""Streams that flow: text deltas from an incremental detokenizer (runpod_vlm.text_deltas.TextDeltas),
sent as soon as they are stable, joining to exactly the answer a non-streamed job gets."""

from __future__ import annotations

import asyncio

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import handler
from runpod_vlm.text_deltas import TextDeltas
from tools.sample_images import data_uri, striped

# Mixed ASCII, 2-, 3- and 4-byte characters.
TEXT = "Le café au lait, s'il vous plaît: 日本の猫 🐈 et 20 €. " * 6


def merging_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE whose merges join the last byte of a character to the next one ("©" of "é" with
    " "), so that tokens end and start inside characters, as real BPE vocabularies do."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    merges = []
    for left, right in [("©", "Ġ"), ("Ã", "©"), ("æ", "Ĺ"), ("¥", "æ"), ("Ĥ", "¬"), ("ð", "Ł"), ("â", "Ĥ")]:
        merges.append((left, right))
        vocab[left + right] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


class CountingTokenizer:
    """The tokenizer, counting the token ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def test_tokens_start_and_end_inside_characters():
    tokenizer = merging_tokenizer()
    ids = tokenizer.encode(TEXT)
    pieces = [tokenizer.decode(ids[: n + 1]) for n in range(len(ids))]
    assert sum(piece.endswith("\ufffd") for piece in pieces) > 20  # prefixes that stop mid-character
    assert tokenizer.decode(ids) == TEXT


@pytest.mark.parametrize("step", [1, 3, 8])
def test_deltas_flow_throughout_and_join_to_the_whole_text(step):
    tokenizer = CountingTokenizer(merging_tokenizer())
    ids = tokenizer.tokenizer.encode(TEXT)
    deltas, text = [], TextDeltas(tokenizer)
    for end in range(step, len(ids) + step, step):
        deltas.append(text.delta(ids[:end]))
    assert "".join(deltas) == TEXT  # leading spaces are dropped (none here); answers hold trailing ones
    assert not any("\ufffd" in delta for delta in deltas)
    # Nothing waits longer than a character takes: at most 4 tokens behind, so almost every step sends.
    held = sum(not delta for delta in deltas)
    assert held <= len(deltas) // (2 if step == 1 else 4), (held, len(deltas))
    # O(new tokens) a delta: each id is decoded a bounded number of times, not once per step after it.
    assert tokenizer.decoded <= 5 * len(ids) + 8 * step, (tokenizer.decoded, len(ids))


def test_a_broken_character_is_sent_once_it_can_no_longer_complete():
    tokenizer = merging_tokenizer()
    stray = tokenizer.encode("\x80")  # not UTF-8 on its own: the byte-level alphabet's token for 0x80
    ids = tokenizer.encode("ok ") + [stray[0]] * 5 + tokenizer.encode(" fine")
    text, sent = TextDeltas(tokenizer), []
    for end in range(1, len(ids) + 1):
        sent.append(text.delta(ids[:end]))
    assert "".join(sent) == tokenizer.decode(ids)
    assert "\ufffd" in "".join(sent[: len(ids) - 2])  # sent before the answer's end, not held to it


def test_a_streamed_answer_arrives_in_pieces_throughout_and_joins_to_the_whole_answer(tiny_model, serve):
    serve(tiny_model("qwen2-vl"), VLM_STREAM_INTERVAL_MS="0", VLM_SYNC_INTERVAL="8")
    job = {"task": "caption", "image_url": data_uri(striped()), "max_new_tokens": 200, "min_new_tokens": 200}
    whole = asyncio.run(handler.local_test_answer({"id": "whole", "input": job}))
    chunks = asyncio.run(handler.local_test_answer({"id": "streamed", "input": dict(job, stream=True)}))
    assert "".join(chunk["text"] for chunk in chunks) == whole["response"]
    assert chunks[-1]["usage"]["completion_tokens"] == 200
    assert len(chunks) >= 20, [len(chunk["text"]) for chunk in chunks]  # 25 steps of 8 tokens


def test_closing_the_engine_while_a_row_decodes_fails_it_as_stopping(tiny_model, serve):
    """handler.reset_engine() on a busy engine: the row's job is told, and close() raises nothing (its rows'
    state is inference-mode tensors, made on the engine thread)."""
    import threading

    from runpod_vlm.vocabulary import RequestError, StreamDelta

    engine = serve(tiny_model("qwen2-vl"), VLM_MAX_NEW_TOKENS="2000")
    item_job = {"messages": [{"role": "user", "content": "Talk."}], "max_new_tokens": 2000, "min_new_tokens": 2000}
    _, item = handler.read_job_item(item_job, engine.settings, engine.model_id)
    events, decoding = [], threading.Event()

    def listen(event):
        events.append(event)
        if isinstance(event, StreamDelta):
            decoding.set()

    engine.submit(item, listen, stream=True)
    assert decoding.wait(60)
    handler.reset_engine()
    assert isinstance(events[-1], RequestError) and events[-1].code == "worker_stopping", events[-1]
