"""What a run is: config sections and presets, the run config, the layout and batch plan, parameter table, curriculum"""
