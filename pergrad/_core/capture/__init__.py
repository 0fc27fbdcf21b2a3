"""pergrad._core.capture"""
