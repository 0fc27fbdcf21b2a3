"""pergrad._core.parallel"""
