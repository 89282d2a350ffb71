"""The torch and transformers attributes the stubbed suite fakes (STUBBED_API), and the record of each use."""

from __future__ import annotations

import contextlib

# =================================================================================================
# The stubbed API surface
# =================================================================================================

STUBBED_API = frozenset(
    {
        # torch
        "torch.cuda.is_available",
        "torch.cuda.is_bf16_supported",
        "torch.float32",
        "torch.float16",
        "torch.bfloat16",
        "torch.inference_mode",
        "torch.stack",
        "torch.cat",
        "torch.Tensor.shape",
        "torch.Tensor.__getitem__",
        "torch.Tensor.tolist",
        "torch.Tensor.to",
        "torch.Tensor.sum",
        # torch: pixels moved to the GPU (the stand-in of cached images, one row repeated, moved once)
        "torch.Tensor.ndim",
        "torch.Tensor.stride",
        "torch.Tensor.is_floating_point",
        "torch.Tensor.element_size",
        "torch.Tensor.__len__",
        # torch: a preempted request's prompt followed by its tokens
        "torch.tensor",
        "torch.Tensor.dtype",
        "torch.Tensor.device",
        # torch: images processed on the GPU by the intake, on a stream of its own (VLM_PREPROCESS_ON_GPU)
        "torch.device",
        "torch.cuda.Stream",
        "torch.cuda.stream",
        "torch.cuda.Stream.synchronize",
        # torch: the compiled path and the GPU's memory (torch.compile, synchronize, empty_cache)
        "torch.compile",
        "torch._dynamo.config.patch",
        "torch.cuda.synchronize",
        "torch.cuda.empty_cache",
        # torch: sizing the KV pool from GPU memory
        "torch.cuda.get_device_properties",
        "torch.cuda.get_per_process_memory_fraction",
        "torch.cuda.mem_get_info",
        "torch.cuda.memory_allocated",
        "torch.cuda.memory_reserved",
        # torch: attention kernels on the GPU
        "torch.backends.cuda.enable_cudnn_sdp",
        # torchvision (InternVL2's tiling)
        "torchvision.transforms.functional.to_tensor",
        "torchvision.transforms.functional.normalize",
        # transformers: loading
        "transformers.__version__",
        "transformers.AutoConfig.from_pretrained",
        "transformers.PretrainedConfig.model_type",
        "transformers.PretrainedConfig.get_text_config",
        "transformers.PretrainedConfig.max_position_embeddings",
        "transformers.AutoProcessor.from_pretrained",
        "transformers.AutoModelForImageTextToText.from_pretrained",
        "transformers.AutoModel.from_pretrained",
        "transformers.AutoTokenizer.from_pretrained",
        "transformers.AutoModelForCausalLM.from_pretrained",
        "transformers.BitsAndBytesConfig",
        # transformers: models
        "transformers.PreTrainedModel.eval",
        # the vocabulary's size for the grammar builder, made at boot
        "transformers.PreTrainedModel.get_output_embeddings",
        "torch.nn.Linear.weight",
        "transformers.PreTrainedModel.generate",
        "transformers.PreTrainedModel.device",
        "transformers.PreTrainedModel.dtype",
        "transformers.PreTrainedModel.config",
        "transformers.PreTrainedModel.generation_config",
        "transformers.GenerationConfig.eos_token_id",
        # transformers: processors and tokenizers
        "transformers.ProcessorMixin.__call__",
        "transformers.ProcessorMixin.apply_chat_template",
        "transformers.ProcessorMixin.tokenizer",
        "transformers.ProcessorMixin.image_processor",
        "transformers.BatchFeature.to",
        "transformers.BatchFeature.__getitem__",
        "transformers.BatchFeature.__setitem__",
        "transformers.BatchFeature.__contains__",
        "transformers.PreTrainedTokenizerBase.decode",
        "transformers.PreTrainedTokenizerBase.apply_chat_template",
        "transformers.PreTrainedTokenizerBase.eos_token_id",
        "transformers.PreTrainedTokenizerBase.pad_token_id",
        "transformers.PreTrainedTokenizerBase.padding_side",
        # trust_remote_code model APIs
        "remote.MiniCPMV.chat",
        "remote.InternVLChatModel.chat",
    }
)

USED: set = set()  # stubbed names the handler touched (fakes' own internal use is not recorded)
MISSING: set = set()  # torch/transformers attributes the handler asked for that no stub provides
_QUIET = [0]


def _use(name: str) -> None:
    if not _QUIET[0]:
        USED.add(name)


@contextlib.contextmanager
def _quiet():
    _QUIET[0] += 1
    try:
        yield
    finally:
        _QUIET[0] -= 1
