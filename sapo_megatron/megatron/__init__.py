"""The only package that imports ``megatron.core``: model building, parallel state, the training step, weight
mapping, loss hooks. Importing it registers the import-time stand-ins of :mod:`.cpu_compat` (only where the
real modules are missing); the runtime CPU patches are applied by :func:`.cpu_compat.apply`."""

from sapo_megatron.megatron import cpu_compat

cpu_compat.register_import_stubs()
