"""Numeric ops of Polestar (imported as ``polestar.kernels``).

* :mod:`polestar.kernels.drift` - KL / JS / cosine drift of attention rows, softmax entropy.
* :mod:`polestar.kernels.kmeans` - batched spherical k-means and the "chunks" grouping.
* :mod:`polestar.kernels.quant` - NVFP4 / FP8 / identity quantizers for cluster residuals.
* :mod:`polestar.kernels.proxy_attention` - attention probabilities of probe (proxy) queries.

Each op has a pure-torch ``reference_*`` function, a Triton ``*_triton`` kernel with the same
signature (optional: Triton need not be installed) and a dispatcher taking
``backend="auto" | "triton" | "reference"``.  The Triton wrappers run through opaque
``torch.ops.polestar.*`` operators (:mod:`polestar.kernels._library`), so ``torch.compile``
traces them without graph breaks.  Submodules are not imported here, so importing the package
stays cheap.
"""
