"""The served INT2 token pool (SGLang subclass), its BF16 windows and memory plan."""
