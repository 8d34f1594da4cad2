"""Real vLLM CPU engines on this machine: engine virtual environment, tiny offline model,
fleet launcher. The gateway's own environment never imports vLLM or torch: everything here
drives them as subprocesses of the engine venv's Python."""
