"""``dflash quantize`` and ``--quantize``: weight-only schemes (``schemes``), saved folders (``io``),
the quantize job (``job``) and the speed/acceptance report (``report``)."""
