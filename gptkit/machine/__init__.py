"""What this machine can do, measured: its CPU, timed products in a cache, precision and attention choices, pages"""
