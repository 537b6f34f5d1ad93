"""LoRA (``model.lora``): RL on low-rank adapters over a frozen base (docs/lora.md).

- ``adapters``: the conversions of the plain decoder (the trainer's ``to_lora``, the native
  engine's ``attach_adapters``), the merge both sides compute (``merged_weight``), and the
  adapters' first values;
- ``peft_io``: PEFT adapter directories in and out (``save_peft_adapter``, ``load_peft_adapter``);
- ``replica``: a vLLM replica's side (``load_adapters``: the received adapters merged into its base).
"""
