"""pergrad._core.backward"""
