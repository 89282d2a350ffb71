"""The engine: knows nothing of RunPod jobs or request JSON."""
