"""runpod-vlm's parts, one concern a module. handler.py (the RunPod entry) walks a request through them.

Imports point one way, down this list; no module imports one above it.

  http_server    the worker over HTTP (load-balancing endpoints, local): routes to handler.handler, /ping
  responses_route  OpenAI's /v1/responses: input items read as a chat-completions body; Responses shapes
  openai_route   RunPod's /openai/v1 jobs: OpenAI bodies read as native requests; OpenAI's shapes
  answers        engine events back to a job: whole answers, paced streams, the output fields
  text_deltas    a growing answer's token ids -> text deltas (an incremental detokenizer)
  grounding      boxes in each family's words and coordinates -> boxes in the original pixels
  request        a job's input -> GenerationRequest: fields, hostile-input checks, limits
  media          image specs -> decoded RGB images: count, deadline, pixel budget, safe decoding
  fetch          the SSRF boundary: URL policy, pinned DNS, TLS, redirects, byte caps
  engine/        the model and its thread; knows nothing of RunPod jobs or request JSON
    engine       the facade: submit, warm_up, stop_after; admission, decoding, answers per item
    decoder      continuous batching over the paged KV cache; chunked prefill; sampling; CUDA graphs
    blocks       the KV pool's blocks, handed to rows as their tokens grow
    paged_attention  the text model's attention over the pool, each row reading its own blocks
    intake       each item's processor call on threads while the GPU decodes
    memory       the KV pool's size from GPU memory
    background_compile  the compile thread: row buckets compiled one after the other, then switched to
    compile      the regionally compiled decode step and the compile-artifact cache
    loading      weights source (RunPod's cache), dtype, quantization, model and processor
  families/      prompts and processor inputs as each model card writes them
    base         the cards' generic recipe (FamilyAdapter)
    native       native families whose cards differ from it (Qwen-VL, PaliGemma, Phi-4-multimodal)
    remote       remote-code families, one item at a time (MiniCPM-V, InternVL2, Phi-3-vision)
  vocabulary     the words all layers share: RequestError, Turn, GenerationRequest, Generation
  settings       Settings and the media policy (VLM_* variables), the curated models: read once at boot
"""
