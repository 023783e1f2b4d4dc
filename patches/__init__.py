"""Every alteration of vLLM 0.32.0, one module per hook point; each checks the vLLM version."""
