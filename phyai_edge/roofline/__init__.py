"""roofline"""
