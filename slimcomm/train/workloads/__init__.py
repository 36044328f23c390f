"""Workloads: what a user of slimcomm brings (models, data sets, a text corpus).

Used by the training command (:mod:`slimcomm.train`), the benchmarks and the
tests; never imported by the library core (:mod:`slimcomm.ops`,
:mod:`slimcomm.hooks`, :mod:`slimcomm.ist`, ...).

* :mod:`slimcomm.train.workloads.data`: IDX reader, Fashion-MNIST / digits, per-rank shards.
* :mod:`slimcomm.train.workloads.models`: the MLP, a small convnet, a decoder-only GPT.
* :mod:`slimcomm.train.workloads.text`: a plain-text corpus (Debian ``fortunes`` or
  any file), char/byte tokens, per-rank training windows, fixed validation batches.
"""
