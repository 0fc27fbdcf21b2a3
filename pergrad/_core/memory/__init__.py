"""pergrad._core.memory"""
