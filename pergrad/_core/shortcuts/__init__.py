"""pergrad._core.shortcuts"""
