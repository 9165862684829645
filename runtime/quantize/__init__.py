"""``dflash quantize``: the quantize job (``job``) and its speed/acceptance report (``report``).
The schemes and the saved folders that loading needs sit below the pipeline, in
``runtime.models.quant_schemes`` and ``runtime.models.quantized``."""
