"""The only package that imports ``megatron.core``: model building, parallel state, the training step, weight
mapping, loss hooks. Importing it registers the import-time stand-ins of :mod:`.cpu_compat` (only where the
real modules are missing) and, without CUDA, imports Megatron-Core without ``torch.compile`` (patch 10 there);
the runtime CPU patches are applied by :func:`.cpu_compat.apply`. It also hides
Megatron-Core's import-time "Transformer Engine / Apex not installed" notices where CUDA is absent
(:func:`sapo_megatron.runtime.logs.filter_cpu_fallback_warnings`): before it is imported, the command line has not
loaded torch to ask."""

from sapo_megatron.megatron import cpu_compat
from sapo_megatron.runtime import logs

logs.filter_cpu_fallback_warnings()
cpu_compat.register_import_stubs()
cpu_compat.import_megatron_eagerly()
