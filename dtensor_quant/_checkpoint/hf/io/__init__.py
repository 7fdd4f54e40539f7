"""The files of a Hugging Face directory, apart from what they hold: reading and writing safetensors bytes.

:mod:`.safetensors_io` reads headers and a rank's byte ranges (and the
shard index), :mod:`.commit` moves a finished export into place through a
journal that survives a kill, and :mod:`.fields` checks every JSON field
(``config.json``, a producer's ``quantization_config``, bitsandbytes'
``quant_state``) where it is read. Nothing here knows formats, producers or
models: the steps above (matching, loading, saving, the producers' readers)
use it.
"""
