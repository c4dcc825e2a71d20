"""The embedded demo: a small Llama trained at first use on the Python standard library's source, its own
byte-level BPE, and LoRA adapters fine-tuned on slices of that text (corpus.py), built once into a cache.

`build_demo()` gives the paths of the full build `loraplex demo` serves (a few minutes to build on two CPU cores,
then reused); `build_demo(size=FAST)` a smaller one built in seconds, which the tests use. Importing this package
imports neither torch nor transformers; only a build does.
"""
from worker.demo.cache import MARKER, DemoAssets, build_demo, default_cache_dir, is_complete
from worker.demo.spec import ADAPTERS, FAST, FULL, SERVED_MODEL_NAME, SIZES, DemoAdapter, DemoSize

__all__ = ["ADAPTERS", "FAST", "FULL", "MARKER", "SERVED_MODEL_NAME", "SIZES", "DemoAdapter", "DemoAssets",
           "DemoSize", "build_demo", "default_cache_dir", "is_complete"]
