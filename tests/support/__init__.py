"""The tests' support, split by what it fakes or provides (test_handler.py's stubs, and helpers of the real-engine
tests).

  stubbed_api   the torch/transformers attributes the stubbed suite fakes, and their use recorded
  fake_torch    a tiny pure-Python torch
  fake_hub      the scripted hub: tokenizer, processors, models, the stub modules
  fake_decoder  PagedDecoder's protocol in plain Python
  fixtures      the stubbed suite's fixtures: the fakes in sys.modules, a fresh hub per test, no network
  interpreted_kernel  the decode kernel under Triton's interpreter (run by test_decode_kernel.py)

A fake torch/transformers for the stubbed suite (test_handler.py): no real torch is imported.

Importing these modules installs nothing. The fixtures (`stub_modules`, `hub`, `web`), which
test_handler.py binds, put the fakes into sys.modules for that module only and remove them afterwards.

The fakes are a scripted "hub": AutoConfig knows a few model ids, the fake processor/tokenizer encode
text one character per token, and every fake model answers with `HUB.reply` (a string or a function
of the prompt), whether it is driven through generate(), a hand-written decode loop (forward calls
that return one-hot logits), or a remote-code `chat()`. They record what they receive, so tests can
assert on handler outputs and on what the model was given, never on the engine's internals.

Every stubbed torch/transformers attribute the handler touches is listed in STUBBED_API; the stubs
record each use, a test checks that the handler exercises exactly that list, and each test fails if
the handler reaches for a torch/transformers attribute the stubs do not provide.
tests/test_stub_honesty.py checks the list against the real libraries.
"""
