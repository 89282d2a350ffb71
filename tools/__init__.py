"""What the tests and the benchmarks share: tiny random-weight models built offline (tiny_models, tiny_families,
legacy_models), sample images (sample_images) and a loopback stand-in of RunPod's job queue (runpod_queue)."""
