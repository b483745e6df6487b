"""Teacher scoring and on-policy distillation in the RL loop: the ``teachers`` config section
(:mod:`~sapo_megatron.distill.config`), the teachers and their scoring on the main rank
(:mod:`~sapo_megatron.distill.teachers`), and the step-side fusion of teacher advantages into the micro-batches
with the SAF schedule (:mod:`~sapo_megatron.distill.step`). The tensor math lives in :mod:`sapo_megatron.algo`.
"""
