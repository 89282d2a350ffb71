"""The one-at-a-time path: the items of a family outside the batch, answered by its repository's `chat()` (the
remote-code families) or the model's own `generate()` (a model whose attention the paged cache cannot take)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from runpod_vlm.engine.ticket import Ticket, generation
from runpod_vlm.vocabulary import GENERATION_FAILED, GenerationParams, GenerationRequest, RequestError, join_param

log = logging.getLogger("runpod-vlm")


def sampling_kwargs(params: GenerationParams) -> dict:
    """`params` as `generate()` (and the remote-code `chat()`s) take them."""
    kwargs: dict = {"max_new_tokens": params.max_new_tokens, "do_sample": params.do_sample}
    if params.do_sample:
        kwargs.update(temperature=params.temperature, top_p=params.top_p)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    if params.min_new_tokens:
        kwargs["min_new_tokens"] = params.min_new_tokens
    return kwargs


class OneAtATime:
    """Items run alone on the engine thread (the engine's `alone`)."""

    def __init__(self, loaded, tokenizer, eos_ids: set, context_error: Callable):
        """`loaded`: the model, its processor, adapter and dtype (loading.LoadedModel); `context_error(item,
        prompt_tokens)`: the error of a prompt past the context, or None."""
        self.model, self.processor = loaded.model, loaded.processor
        self.adapter, self.dtype = loaded.adapter, loaded.dtype
        self.tokenizer, self.eos_ids, self.context_error = tokenizer, eos_ids, context_error

    def run(self, ticket: Ticket) -> None:
        """An item of a family outside the batch, alone."""
        item = ticket.item
        try:
            if item.params.do_sample and item.params.seed is not None:  # one item at a time: the global generator
                import torch

                torch.manual_seed(item.params.seed)
            if item.params.json_schema is not None:
                message = f"the {self.adapter.name} family answers one request at a time, without structured output"
                raise RequestError("unsupported_parameter", message, join_param(item.param, item.params.schema_param))
            if item.params.logprobs and not self.adapter.native:
                message = f"the {self.adapter.name} family answers through its repository's chat(), which gives none"
                raise RequestError("unsupported_parameter", message, join_param(item.param, "logprobs"))
            if self.adapter.native:
                ticket.finish(self.generate(item))
            else:
                ticket.finish(self.adapter.run(self.model, self.processor, item, sampling_kwargs(item.params)))
        except RequestError as error:
            ticket.finish(error)
        except Exception:
            log.exception("generation failed")
            ticket.fail(GENERATION_FAILED)

    def generate(self, item: GenerationRequest):
        """`item` through the model's own `generate()` (the card's recipe): its Generation, or the RequestError of a
        prompt past the context."""
        import torch

        inputs, input_sizes = self.adapter.batch_inputs(self.processor, [item], self.model.device, self.dtype)
        prompt_tokens = int(inputs["attention_mask"].sum())
        error = self.context_error(item, prompt_tokens)
        if error:
            return error
        kwargs = dict(eos_token_id=sorted(self.eos_ids), **sampling_kwargs(item.params))
        with torch.inference_mode():
            if not item.params.logprobs:
                out = self.model.generate(**inputs, **kwargs)
                ids = out[0, inputs["input_ids"].shape[1] :].tolist()
                return generation(self.tokenizer, self.eos_ids, item, ids, prompt_tokens, input_sizes[0])
            out = self.model.generate(**inputs, **kwargs, output_logits=True, return_dict_in_generate=True)
            ids = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
            logprobs = []  # of generate's raw logits, before its processors, as on the batched path
            for step, token in zip(out.logits, ids):
                step_logprobs = torch.log_softmax(step[0].float(), dim=-1)
                top_logprobs, top_ids = step_logprobs.topk(min(20, step_logprobs.shape[-1]))
                logprobs.append((step_logprobs[token].item(), top_ids.tolist(), top_logprobs.tolist()))
        return generation(self.tokenizer, self.eos_ids, item, ids, prompt_tokens, input_sizes[0], logprobs)
