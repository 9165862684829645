"""`dflash serve`: the OpenAI-compatible HTTP server (app, protocol, queue, metrics) and the
vLLM/SGLang command builders. Consumes runtime events only."""
