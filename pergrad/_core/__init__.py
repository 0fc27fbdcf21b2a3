"""pergrad._core"""
