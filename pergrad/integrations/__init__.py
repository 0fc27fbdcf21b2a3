"""pergrad.integrations"""
