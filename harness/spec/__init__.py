"""What a case is: the schema, loading case files, units, variants, run shapes, and the DeepSpeed
config a case implies."""
