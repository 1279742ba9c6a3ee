"""Test, benchmark and demo scaffolding; no product module imports it.

- `toy`: a local corpus, byte-level BPE tokenizers and tiny models (nothing downloaded).
- `toy_teacher`: a vLLM-servable toy teacher with a padded lm_head, for stage 1.
- `suite`: the test suite's toy setup (`TEST_SPEC`, built once under `TEST_CACHE`), shared with
  the benchmarks that reuse it.
- `caches`: a teacher cache written through `CacheWriter` without stage 1.
- `rates`: a stage 2 loader's rate alone.
- `devices`: fake CUDA / accelerator tensors that fail on any operation mixing devices.

Only `tests/`, `bench/` and the demo (`xtcache.app.demo.offpolicy`, an app module) import this package.
"""
