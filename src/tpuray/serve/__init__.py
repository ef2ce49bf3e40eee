"""tpuray.serve: model serving on Ray Serve (see `tpuray.serve.llm`)."""
