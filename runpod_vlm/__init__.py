"""runpod-vlm's parts, one concern a module. handler.py (the RunPod entry) walks a request through them.

Imports point one way, down this list; no module imports one above it. Only handler.py knows the RunPod SDK;
the engine knows nothing of RunPod jobs or request JSON; the scheduler never touches a tensor.

  http_server    the worker over HTTP (load-balancing endpoints, local): routes to handler.handler, /ping, /metrics
  responses_route  OpenAI's /v1/responses: input items read as a chat-completions body; Responses shapes
  openai_route   RunPod's /openai/v1 jobs: OpenAI bodies read as native requests; OpenAI's shapes
  tools          function tools: read from a request, the call a constrained answer is, calls read back
  metrics        Prometheus counters, histograms and the engine's gauges; the queue mode's log line
  answers        engine events back to a job: whole answers, choices, paced streams, the output fields
  text_deltas    a growing answer's token ids -> text deltas (an incremental detokenizer)
  grounding      boxes in each family's words and coordinates -> boxes in the original pixels
  request        a job's input -> GenerationRequest: fields, hostile-input checks, limits
  video          videos fetched under the media policy and probed (header checks, no frame decoded)
  frames         which frames a card samples, and decoding only those (bounded by frames decoded)
  media          image specs -> decoded RGB images: count, deadline, pixel budget, safe decoding
  fetch          the SSRF boundary: URL policy, pinned DNS, TLS, redirects, byte caps
  lru            a least-recently-used map bounded in bytes (the image caches)
  engine/        the model and its thread; knows nothing of RunPod jobs or request JSON
    engine       the facade and its thread: submit, warm_up, view, stop_after; wires the parts below
    scheduler    the plan of each step in plain Python: queue, rows, chunking, row cap, preemption, KV bookkeeping
    runner       the engine thread carrying out the plan on the decoder: placing prompts, chunks, decode intervals
    ticket       one item's way through the engine, and the events it sends its job
    view         a read-only snapshot of the engine (metrics, tests, benchmarks)
    intake       each item's processor call on threads (videos on one of their own) while the GPU decodes
    grammar      structured output: a schema's grammar built off the engine thread, its token masks
    one_at_a_time  the families outside the batch: each item through generate() or its repository's chat()
    decoder      continuous batching over the paged KV cache: rows' state, decode steps, their tokens to the host
    prefill      new prompts into rows' blocks: packed or padded, or one long prompt in chunks
    decoder_graphs  which CUDA graphs the decoder records, and when
    prefill_graphs  short prefills replayed as CUDA graphs
    vision_graphs  a packed vision tower's passes replayed as CUDA graphs
    sampling     a step's next token per row: penalty, min_new_tokens, grammar mask, greedy or sampled, logprobs
    blocks       the KV pool's blocks and the prefix cache's digests
    paged_attention  the text model's attention over the pool, each row reading its own blocks
    long_rope    LongRoPE's factors chosen per row (Phi-4-multimodal), as generate() chooses them alone
    decode_kernel  a decode step's attention on the GPU (a Triton kernel over each row's blocks)
    varlen       variable-length FlashAttention for packed sequences
    vision_attention  one attention call per layer for a vision tower that packs its images
    projections  projections that read the same input computed as one product
    host_copies  copies between the host and the GPU that never wait for it
    image_cache  vision-encoder outputs kept by image
    memory       the KV pool's size from GPU memory; the text model without its head
    background_compile  the compile thread: row buckets compiled one after the other, then switched to
    compile      the regionally compiled decode step and vision blocks, and the compile-artifact cache
    loading      weights source (RunPod's cache), dtype, quantization, model and processor
    fp8          FP8 weights for the language model's linear layers (VLM_QUANTIZE=fp8)
    gpu_errors   what a failed CUDA call means
  families/      prompts and processor inputs as each model card writes them
    base         the cards' generic recipe (FamilyAdapter), chat templates with tools
    native       native families whose cards differ from it (Qwen-VL, PaliGemma, Phi-4-multimodal)
    remote       remote-code families, one item at a time (MiniCPM-V, InternVL2, Phi-3-vision)
  vocabulary     the words all layers share: RequestError, Turn, ToolUse, GenerationRequest, Generation
  settings       Settings and the media policy (VLM_* variables), the curated models: read once at boot
"""
